"""Fault 6: retry storms.

A client retrying a long non-streaming generation on a short timeout, with an Idempotency-Key,
pays once: its hang-ups do not cancel the generation (the answer is stored), retries while it
runs get 409, and the first retry after it ends gets the stored answer. Without a key, each
retry is a new request admitted against the retrying tenant's own limits only: another tenant
keeps being served.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from catalog.models import Pool
from infra.redis_conn import get_redis
from tests import faults, procs
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "fault-r-pool", "sim-fault-r"
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "5",
       "SSE_KEEPALIVE_SECONDS": "0.5"}
MSGS = [{"role": "user", "content": "Write a long essay."}]


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(streams=50, **extra)


def post(url: str, plain: str, body: dict[str, Any], timeout: float,
         idem: str | None = None) -> tuple[int, str | None, dict[str, Any] | None]:
    headers = {"Authorization": f"Bearer {plain}"}
    if idem:
        headers["Idempotency-Key"] = idem
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers,
                       timeout=timeout)
    except httpx.TimeoutException:
        return 0, None, None  # the client gave up: it will retry
    return r.status_code, r.headers.get("x-request-id"), r.json()


def run_retry_storm(redis_client: Any) -> dict[str, Any]:
    model = make_model(MODEL)
    Pool.objects.create(name=POOL, model=model, max_sequences=16, backend_settings={
        "decode_tokens_per_s": 100.0, "pool_tokens_per_s": None})
    keyed_t, storm_t, calm_t = (make_tenant(**quota()), make_tenant(**quota(concurrent_requests=3)),
                                make_tenant(**quota()))
    keyed, storm, calm = (make_key(t) for t in (keyed_t, storm_t, calm_t))
    r = get_redis()
    worker = procs.start_worker(POOL, worker_id="fr-1", env=ENV)
    gw, url = procs.start_uvicorn(env=ENV)
    with procs.supervised(worker, gw, tail=3000):
        procs.wait_for_worker(r, POOL, "fr-1", worker)
        procs.wait_for_http(url + "/healthz", gw)
        long_body = {"model": MODEL, "messages": MSGS, "max_tokens": 250}  # ~2.5 s
        # 1. With a key: time out after 0.4 s, retry every 0.2 s until an answer comes.
        attempts: list[int] = []
        answer: dict[str, Any] | None = None
        t0 = time.monotonic()
        while answer is None and time.monotonic() - t0 < 20:
            status, _, body = post(url, keyed[1], long_body, 0.4, idem="essay-1")
            attempts.append(status)
            if status == 200:
                answer = body
            time.sleep(0.2)
        # 2. Without a key: a storm of retries on a 0.3 s timeout, while a calm tenant works.
        def storm_client(i: int) -> list[int]:
            return [post(url, storm[1], long_body, 0.3)[0] for _ in range(6)]

        def calm_client(i: int) -> tuple[int, float]:
            start = time.monotonic()
            status, _, _ = post(url, calm[1], {**long_body, "max_tokens": 30}, 20)
            return status, time.monotonic() - start

        with ThreadPoolExecutor(16) as ex:
            storms = [ex.submit(storm_client, i) for i in range(8)]
            time.sleep(0.5)
            calms = [ex.submit(calm_client, i) for i in range(6)]
            storm_statuses = [s for f in storms for s in f.result()]
            calm_results = [f.result() for f in calms]
        tenants = [keyed_t, storm_t, calm_t]
        procs.wait_until(lambda: not faults.nonzero_counters(
            r, tenants, [k for k, _ in (keyed, storm, calm)]), 20, "counters back to zero")
        records = faults.settled_records(r)

        def mine(tenant: Any) -> list[dict[str, Any]]:
            return [x for x in records.values() if x["tenant_id"] == tenant.pk]

        return {"attempts": attempts, "answer": answer, "keyed_records": mine(keyed_t),
                "storm_statuses": storm_statuses, "storm_records": mine(storm_t),
                "calm": calm_results, "calm_records": mine(calm_t)}


def report(res: dict[str, Any]) -> str:
    storm = res["storm_statuses"]
    return faults.table("retry storms", [
        ("idempotent retries (status per try)", res["attempts"]),
        ("  usage records / tokens billed", f"{len(res['keyed_records'])} / "
         f"{sum(x['completion_tokens'] for x in res['keyed_records'])}"),
        ("storm tries: timeout / 429 / other", f"{storm.count(0)} / {storm.count(429)} / "
         f"{len(storm) - storm.count(0) - storm.count(429)}"),
        ("  storm records (each billed what it generated)", len(res["storm_records"])),
        ("calm tenant ok / max latency (s)",
         f"{sum(s == 200 for s, _ in res['calm'])}/{len(res['calm'])} / "
         f"{max(t for _, t in res['calm']):.2f}"),
    ])


def test_retry_storms(redis_client) -> None:
    res = run_retry_storm(redis_client)
    report(res)
    # With an Idempotency-Key: one request ran, one record, the whole answer; retries that
    # came while it ran were told 409 (or timed out), never started a second generation.
    assert res["answer"] is not None
    assert len(res["keyed_records"]) == 1
    rec = res["keyed_records"][0]
    assert rec["status"] == "ok" and rec["error_code"] is None
    assert res["answer"]["usage"]["completion_tokens"] == rec["completion_tokens"] > 0
    assert set(res["attempts"][:-1]) <= {0, 409} and len(res["attempts"]) >= 3
    # Without a key: every try is its own request, within the storm tenant's limits only.
    storm = res["storm_statuses"]
    assert 429 in storm  # its concurrency limit (3) held
    # Each was cancelled when its client hung up, billed for what it generated by then.
    assert {x["error_code"] for x in res["storm_records"]} == {"client_disconnect"}
    assert all(s == 200 for s, _ in res["calm"])  # the other tenant is unaffected
    assert len(res["calm_records"]) == len(res["calm"])
