"""Fault 1: a pool worker is SIGKILLed with 100 streams in flight; a second worker lives on.

Every client of the dead worker gets a retryable ``worker_lost`` error within the heartbeat
timeout (+ one janitor sweep); every request is settled exactly once and bills exactly the
tokens its stream carried; no request runs on both workers; requests still queued are served
by the survivor; counters, queues, in-flight sets and reserved KV return to zero.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from catalog.models import Pool
from infra.redis_conn import get_redis
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "fault-w-pool", "sim-fault-w"
DEAD_AFTER = 1.5
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": str(DEAD_AFTER),
       "SSE_KEEPALIVE_SECONDS": "0.5"}
STREAMS = 100
SEQS = 45  # per worker: 90 run at once, 10 wait in the queue


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(streams=500, ttft_s=40.0, total_s=60.0, **extra)


def run_worker_lost(redis_client: Any) -> dict[str, Any]:
    """The scenario; returns what happened (also used by bench/faults.py)."""
    model = make_model(MODEL)
    Pool.objects.create(name=POOL, model=model, max_sequences=SEQS, backend_settings={
        "decode_tokens_per_s": 25.0, "pool_tokens_per_s": None})
    tenant = make_tenant(**quota())
    api_key, plain = make_key(tenant)
    r = get_redis()
    w1 = procs.start_worker(POOL, worker_id="fw-1", env=ENV)
    w2 = procs.start_worker(POOL, worker_id="fw-2", env=ENV)
    gw, url = procs.start_uvicorn(env=ENV)
    with procs.supervised(w1, w2, gw, tail=3000):
        procs.wait_for_worker(r, POOL, "fw-1", w1)
        procs.wait_for_worker(r, POOL, "fw-2", w2)
        procs.wait_for_http(url + "/healthz", gw)
        victims: set[str] = set()
        killed_at: list[float] = []

        def kill_when_busy(tasks: list[Any]) -> None:
            procs.wait_until(lambda: r.scard(rkeys.inflight_key(POOL, "fw-1")) >= SEQS // 2
                             and r.hlen(rkeys.pool_key("wfq", POOL, "items")) > 0,
                             30, "a busy worker")
            time.sleep(0.5)  # let its streams carry some tokens
            victims.update(x.decode() for x in r.smembers(rkeys.inflight_key(POOL, "fw-1")))
            killed_at.append(time.monotonic())
            w1.kill()

        body = {"model": MODEL, "messages": [{"role": "user", "content": "A long story."}],
                "max_tokens": 100}
        outcomes, _ = faults.stream_many(url, plain, body, STREAMS, during=kill_when_busy)
        procs.wait_until(lambda: not faults.nonzero_counters(r, [tenant], [api_key]), 20,
                         "counters back to zero")
        records = faults.settled_records(r)
        # The load hash is the survivor's heartbeat snapshot: give it a beat to catch up.
        leftovers = faults.wait_quiet(r, POOL, ["fw-2"])
        by_rid = {o.rid: o for o in outcomes}
        lost = [by_rid[rid] for rid in victims if rid in by_rid]
        return {
            "outcomes": outcomes, "victims": victims, "lost": lost, "records": records,
            "leftovers": leftovers, "killed_at": killed_at[0],
            "stream_tokens": {rid: faults.stream_tokens(r, rid) for rid in records},
            "terminals": {rid: len(faults.terminal_entries(r, rid)) for rid in records},
            "survivor_alive": w2.alive(),
        }


def report(res: dict[str, Any]) -> str:
    lost, outcomes = res["lost"], res["outcomes"]
    delays = [o.ended - res["killed_at"] for o in lost]
    others = [o for o in outcomes if o.rid not in res["victims"]]
    return faults.table("worker lost mid-stream (SIGKILL, 1 of 2 workers)", [
        ("streams", len(outcomes)),
        ("in flight on the killed worker", len(res["victims"])),
        ("  ended with worker_lost", sum(o.error == "worker_lost" for o in lost)),
        ("  error after kill p50/max (s)",
         f"{faults.pct(delays, 0.5):.2f} / {max(delays, default=0):.2f}"),
        ("others completed by survivor", f"{sum(o.ok for o in others)}/{len(others)}"),
        ("usage records", len(res["records"])),
        ("leftovers (queue, inflight, kv)", res["leftovers"]),
    ])


def test_worker_killed_mid_stream(redis_client) -> None:
    res = run_worker_lost(redis_client)
    report(res)
    outcomes, lost, records = res["outcomes"], res["lost"], res["records"]
    assert len(lost) >= SEQS // 2
    # Every affected client: a retryable error, within the heartbeat timeout + a sweep + slack.
    assert all(o.error == "worker_lost" for o in lost), {o.error for o in lost}
    assert max(o.ended - res["killed_at"] for o in lost) < DEAD_AFTER + 2.5
    # Everything else (including what was still queued) was served by the survivor.
    others = [o for o in outcomes if o.rid not in res["victims"]]
    assert len(others) == STREAMS - len(lost) and all(o.ok for o in others), \
        [(o.status, o.error) for o in others if not o.ok][:5]
    assert res["survivor_alive"]
    # Settled exactly once, billing exactly what its stream carried; one final entry each
    # (a request that ran twice would carry two, or more tokens than it billed).
    assert {o.rid for o in outcomes} == set(records)
    for rid, rec in records.items():
        assert rec["completion_tokens"] == res["stream_tokens"][rid], rec
        assert res["terminals"][rid] == 1, rid
    for o in others:
        assert o.usage == {k: records[o.rid][k] for k in o.usage if k in records[o.rid]} or \
            o.usage["completion_tokens"] == records[o.rid]["completion_tokens"]
    assert {records[o.rid]["error_code"] for o in lost} == {"worker_lost"}
    assert not any(res["leftovers"].values()), res["leftovers"]
