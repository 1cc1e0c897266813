"""Two cells on one machine (docs/adr/0019), called with the official openai client.

Each cell is a real gateway (uvicorn) and a real pool worker on its own ``redis-server``; both
share the test's PostgreSQL, as the cells of a deployment share theirs. Checked:

- a tenant whose home is ``east`` calling ``west`` is forwarded and served by ``east``, streams
  included; ``west``'s Redis never sees its buckets;
- a tenant split across both cells, loaded from both at once while the rebalancer runs, is held
  within the bound of its one quota: completion tokens <= B + R*T/60.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from django.core.management import call_command
from django.db import connection

from catalog.models import Pool
from serving import cells
from tests import procs
from tests.cell_redis import CellRedis
from tests.factories import make_key, make_model, make_tenant
from workers import cell_quota

# Non-transactional: the module fixture commits its rows for the processes; tests write none.
pytestmark = [pytest.mark.integration, pytest.mark.django_db]

MODEL = "sim-cells"
CELLS = ("east", "west")
BIG = 10**9
OUT_RATE, OUT_BURST = 1_200, 200  # the split tenant: 20 output tokens a second, 200 at once
MAX_TOKENS = 10


def limits(**over: Any) -> dict[str, Any]:
    base = {"input_tpm": BIG, "input_burst": BIG, "output_tpm": BIG, "output_burst": BIG,
            "concurrent_requests": 100, "open_streams": 100, "max_output_tokens": 1000,
            "ttft_deadline_s": 30.0, "total_deadline_s": 60.0}
    return {**base, **over}


@pytest.fixture(scope="module")
def two_cells(django_db_setup, django_db_blocker) -> Iterator[dict[str, Any]]:
    group = CellRedis(list(CELLS)).start()
    ports = {c: procs.free_port() for c in CELLS}
    urls = {c: f"http://127.0.0.1:{ports[c]}" for c in CELLS}
    spec = {c: {"url": urls[c], "redis_url": group.url(c)} for c in CELLS}
    with django_db_blocker.unblock():
        model = make_model(MODEL)
        for c in CELLS:
            Pool.objects.create(name=f"{c}-pool", model=model, cell=c, max_sequences=64,
                                backend_settings={"decode_tokens_per_s": 500.0,
                                                  "pool_tokens_per_s": None})
        home = make_tenant(**limits())
        home.home_cell = "east"
        home.save()
        split = make_tenant(**limits(output_tpm=OUT_RATE, output_burst=OUT_BURST))
        split.home_cell, split.extra_cells = "east", "west"
        split.save()
        keys = {"home": make_key(home)[1], "split": make_key(split)[1]}
    try:
        with contextlib.ExitStack() as stacks:
            ups = {c: stacks.enter_context(procs.stack(
                {f"{c}-w1": f"{c}-pool"}, port=ports[c], redis_client=group.client(c),
                env={"CELL": c, "CELLS": json.dumps(spec), "REDIS_URL": group.url(c),
                     "CELL_SHARE_FLOOR": "0.1", "WORKER_HEARTBEAT_SECONDS": "0.2"}))
                for c in CELLS}
            started = [p for up in ups.values() for p in (*up.workers.values(), up.gateway)]
            yield {"urls": urls, "spec": spec, "keys": keys, "redis": group,
                   "tenants": {"home": home.pk, "split": split.pk}, "procs": started}
    finally:
        group.stop()
        with django_db_blocker.unblock():
            # The rows were committed for the processes: empty the tables as a transactional
            # test does, or the modules after this one see this module's tenants and models.
            call_command("flush", verbosity=0, interactive=False)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def ask(c: openai.OpenAI) -> Any:
    return c.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Hi"}])


def test_a_request_to_the_wrong_cell_is_served_by_the_home_cell(two_cells: dict[str, Any]) -> None:
    urls, key = two_cells["urls"], two_cells["keys"]["home"]
    raw = ask(client(urls["west"], key))
    assert raw.headers["x-igw-cell"] == "east"  # answered by the home cell
    assert raw.headers["x-igw-forwarded-by"] == "west"
    assert raw.parse().usage.completion_tokens > 0
    # A stream comes through the forward too, as it is produced.
    stream = client(urls["west"], key).chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, stream=True,
        messages=[{"role": "user", "content": "Hi"}])
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    # Only the home cell's Redis ever held this tenant's buckets.
    bucket = cells._share_keys(two_cells["tenants"]["home"])[1]
    assert two_cells["redis"].client("east").exists(bucket)
    assert not two_cells["redis"].client("west").exists(bucket)
    # Directly at home: no forward.
    direct = ask(client(urls["east"], key))
    assert direct.headers["x-igw-cell"] == "east" and "x-igw-forwarded-by" not in direct.headers


def test_a_split_quota_holds_its_bound_under_load_from_both_cells(
    two_cells: dict[str, Any], settings: Any, django_db_blocker: Any,
) -> None:
    settings.CELLS = two_cells["spec"]
    settings.CELL_SHARE_FLOOR = 0.1
    urls, key = two_cells["urls"], two_cells["keys"]["split"]
    served = {c: 0 for c in CELLS}
    refused = {c: 0 for c in CELLS}
    lock = threading.Lock()
    stop = threading.Event()
    rebalances: list[cells.Rebalance] = []

    def load(cell: str) -> None:
        c = client(urls[cell], key)
        while not stop.is_set():
            try:
                raw = ask(c)
            except openai.RateLimitError:
                with lock:
                    refused[cell] += 1
                time.sleep(0.02)
                continue
            assert raw.headers["x-igw-cell"] == cell  # served where it arrived: a home cell
            with lock:
                served[cell] += raw.parse().usage.completion_tokens

    def rebalancer() -> None:
        # What the Celery beat task runs (cells.rebalance_quotas), every 0.3 s instead of 10.
        try:
            while not stop.is_set():
                rebalances.extend(cell_quota.rebalance_all())
                time.sleep(0.3)
        finally:
            connection.close()

    threads = [threading.Thread(target=load, args=(c,)) for c in ("east", "east", "east", "west")]
    threads.append(threading.Thread(target=rebalancer))
    with django_db_blocker.unblock():
        start = time.time()
        for t in threads:
            t.start()
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(30)
        elapsed = time.time() - start
    total = sum(served.values())
    bound = OUT_BURST + OUT_RATE * elapsed / 60
    print(f"served {served} = {total} tokens in {elapsed:.1f} s, refused {refused}; bound "
          f"{bound:.0f}; {len(rebalances)} rebalances")
    assert total <= bound, (served, refused, elapsed)
    # Tighter: each cell's bucket starts at the floor's burst, and a grown cap adds no tokens.
    quota = cells.Share(BIG, BIG, OUT_RATE, OUT_BURST)
    start_level = 2 * cells.floor_share(quota, 2, 0.1).out_burst
    assert total <= start_level + OUT_RATE * elapsed / 60, (served, refused, elapsed)
    assert all(refused.values()), refused  # the load really exceeded each cell's share
    assert served["east"] > 0 and served["west"] > 0
    # ... and the cells together got most of the rate (bursts start at the floor, and a grown
    # cap adds no tokens: C3, so the burst term of the bound is not reached here).
    assert total >= 0.5 * OUT_RATE * elapsed / 60, (served, refused, elapsed)
    moved = [r for r in rebalances if not r.skipped]
    assert moved, [r.skipped for r in rebalances]
    # East asked three times as often: its share grew past west's.
    last = moved[-1].shares
    print("last shares (output tokens/min, burst):",
          {c: (s.out_rate, s.out_burst) for c, s in last.items()})
    assert last["east"].out_rate > last["west"].out_rate
    assert cells.total(last).out_rate <= OUT_RATE
