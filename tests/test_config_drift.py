"""Configuration drift: the admin changes a model while its workers run.

Raising a model's ``max_model_len`` changes the database at once, but a running worker keeps the
context window its engine was built with until it restarts. The gateway sizes requests by the
window the pool's live workers advertise (their heartbeats), so a prompt between the old and the
new window gets a clean 400 naming the window actually served, never a 500 from the engine,
and is served once the workers run with the new window.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from catalog.models import Pool, ServedModel
from infra.redis_conn import get_redis
from tests import procs
from tests.factories import make_key, make_model, make_tenant

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "drift-pool", "drift-sim"
OLD_WINDOW, NEW_WINDOW = 256, 4096
# The test sends one over-window prompt every 0.2 s on purpose: the repeated-oversize guard
# (gateway.inference.oversize) would rightly turn those 400s into 429s, so it is raised here.
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "2",
       "OVERSIZE_REFUSALS_PER_MINUTE": "1000"}
CATALOG_TTL_S = 2.0  # gateway.inference.pools.TTL: how long a gateway trusts its pool table


def ensure_pool() -> None:
    model = make_model(MODEL, max_model_len=OLD_WINDOW)
    Pool.objects.get_or_create(name=POOL, defaults={
        "model": model, "backend_settings": {"decode_tokens_per_s": 500.0}})


@pytest.fixture(scope="module")
def system(live_system) -> dict[str, Any]:
    return live_system(pool=POOL, worker_ids=["drift-w1"], env=ENV, prepare=ensure_pool)


def ask(url: str, plain: str, words: int) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "tide " * words}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {plain}"})


def served_or_none(url: str, plain: str) -> httpx.Response | None:
    answer = ask(url, plain, 600)
    return answer if answer.status_code == 200 else None


def test_a_raised_context_window_is_used_once_the_workers_serve_it(system, redis_client):
    ensure_pool()
    procs.wait_for_worker(redis_client, POOL, "drift-w1", system["worker"], timeout=10)
    _, plain = make_key(make_tenant())
    assert ask(system["url"], plain, 10).status_code == 200

    # The admin raises the window; the running worker still serves the old one.
    ServedModel.objects.filter(name=MODEL).update(max_model_len=NEW_WINDOW)
    answers = []
    deadline = time.monotonic() + CATALOG_TTL_S + 1.5  # past the gateway's next table read
    while time.monotonic() < deadline:
        answers.append(ask(system["url"], plain, 600))
        time.sleep(0.2)  # pacing only: the assertion covers every answer in the window
    assert {a.status_code for a in answers} == {400}, [a.text for a in answers if
                                                       a.status_code != 400][:1]
    error = answers[-1].json()["error"]
    assert error["code"] == "context_length_exceeded" and str(OLD_WINDOW) in error["message"]

    # A worker started now builds its engine with the new window; once the old one has left,
    # the long prompt is served.
    fresh = procs.start_worker(POOL, worker_id="drift-w2", env=ENV)
    try:
        procs.wait_for_worker(get_redis(), POOL, "drift-w2", fresh)
        system["worker"].stop()
        served = procs.wait_until(lambda: served_or_none(system["url"], plain), 15,
                                  "the long prompt to be served by the new worker", fresh)
        assert served.json()["usage"]["prompt_tokens"] > OLD_WINDOW
    finally:
        fresh.stop()
