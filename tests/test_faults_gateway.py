"""Fault 3: a gateway process dies (SIGKILL) with streams in flight; a second gateway lives.

Its clients see their streams end with an error. Half of them reconnect to the other gateway
with ``Last-Event-ID`` and receive the rest of their stream, no token twice and none missing.
The other half never come back: the dead gateway's heartbeat stops, and the janitor cancels
the requests it was relaying that no live gateway relays (``serving.liveness``), so the engine
aborts them within ``GATEWAY_DEAD_AFTER_SECONDS`` + one sweep and they are billed only for what
was generated until then. Every charge is settled and the counters return to zero.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from catalog.models import Pool
from infra.redis_conn import get_redis
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "fault-g-pool", "sim-fault-g"
GW_DEAD_AFTER = 1.5
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "3",
       "SSE_KEEPALIVE_SECONDS": "0.5", "GATEWAY_HEARTBEAT_SECONDS": "0.2",
       "GATEWAY_DEAD_AFTER_SECONDS": str(GW_DEAD_AFTER)}
STREAMS = 40
MAX_TOKENS = 300  # 7.5 s at 40 tok/s: kill after ~1 s


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(streams=200, **extra)


def run_gateway_restart(redis_client: Any) -> dict[str, Any]:
    model = make_model(MODEL)
    Pool.objects.create(name=POOL, model=model, max_sequences=64, backend_settings={
        "decode_tokens_per_s": 40.0, "pool_tokens_per_s": None})
    tenant = make_tenant(**quota())
    api_key, plain = make_key(tenant)
    r = get_redis()
    worker = procs.start_worker(POOL, worker_id="fg-1", env=ENV)
    gw1, url1 = procs.start_uvicorn(env=ENV)
    gw2, url2 = procs.start_uvicorn(env=ENV)
    with procs.supervised(worker, gw1, gw2, tail=3000):
        procs.wait_for_worker(r, POOL, "fg-1", worker)
        procs.wait_for_http(url1 + "/healthz", gw1)
        procs.wait_for_http(url2 + "/healthz", gw2)
        killed: list[float] = []

        def kill(tasks: list[Any]) -> None:
            procs.wait_until(lambda: r.scard(rkeys.inflight_key(POOL, "fg-1")) >= STREAMS, 20,
                             "streams running")
            time.sleep(1.0)
            killed.append(time.monotonic())
            killed.append(time.time())  # the records' clock (Redis TIME, same host)
            gw1.kill()

        body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}],
                "max_tokens": MAX_TOKENS, "ignore_eos": True}
        first, _ = faults.stream_many(url1, plain, body, STREAMS, during=kill)
        resumers = [o for o in first[::2] if o.last_event_id]
        abandoned = {o.rid for o in first[1::2]}

        async def resume_all() -> list[faults.Outcome]:
            async with httpx.AsyncClient(timeout=30) as client:
                return list(await asyncio.gather(*(
                    faults.one_stream(client, url2, plain, body, resume=o.last_event_id)
                    for o in resumers)))

        resumed = procs.arun(resume_all())
        procs.wait_until(lambda: abandoned <= set(faults.settled_records(r)), 30,
                         "the abandoned requests settled")
        recs = faults.settled_records(r)
        abandoned_settled_after = max(recs[rid]["settled_at_ms"] / 1000 - killed[1]
                                      for rid in abandoned)
        procs.wait_until(lambda: not faults.nonzero_counters(r, [tenant], [api_key]), 40,
                         "counters back to zero")
        settled_at = time.monotonic()
        records = faults.settled_records(r)
        return {"first": first, "resumers": resumers, "resumed": resumed,
                "abandoned_settled_after": abandoned_settled_after,
                "records": records, "killed_at": killed[0], "settled_after": settled_at - killed[0],
                "stream_tokens": {rid: faults.stream_tokens(r, rid) for rid in records},
                "entry_ids": {rid: faults.entry_ids(r, rid) for rid in records},
                "leftovers": faults.wait_quiet(r, POOL, ["fg-1"]),
                "gw2_alive": gw2.alive()}


def report(res: dict[str, Any]) -> str:
    first, recs = res["first"], res["records"]
    resumed_ok = sum(o.ok for o in res["resumed"])
    abandoned = [o for o in first if o not in res["resumers"]]
    ab = [recs[o.rid] for o in abandoned if o.rid in recs]
    codes: dict[str, int] = {}
    for rec in ab:
        label = f"{rec['status']}:{rec.get('error_code') or rec.get('finish_reason')}"
        codes[label] = codes.get(label, 0) + 1
    return faults.table("gateway process killed (SIGKILL, 1 of 2 gateways)", [
        ("streams on the killed gateway", len(first)),
        ("  ended with a transport error", sum(bool(o.error) for o in first)),
        ("resumed on the other gateway (Last-Event-ID)", f"{resumed_ok}/{len(res['resumers'])}"),
        ("abandoned: how they were settled", codes),
        ("  abandoned tokens billed (no one read them)",
         sum(rec["completion_tokens"] for rec in ab)),
        ("abandoned all settled, s after the kill", f"{res['abandoned_settled_after']:.2f}"),
        ("everything settled, s after the kill", f"{res['settled_after']:.2f}"),
        ("leftovers", res["leftovers"]),
    ])


def test_gateway_killed_mid_stream(redis_client) -> None:
    res = run_gateway_restart(redis_client)
    report(res)
    first, records = res["first"], res["records"]
    assert all(o.error and o.error.startswith("transport") for o in first)
    assert len(res["resumers"]) == STREAMS // 2
    # Resumed: the rest of the stream, exactly (every entry once, in order), and the usage
    # the client is told at the end is what was billed.
    for before, after in zip(res["resumers"], res["resumed"], strict=True):
        assert after.ok, after.error
        assert before.entry_ids + after.entry_ids == res["entry_ids"][before.rid]
        rec = records[before.rid]
        assert after.usage and after.usage["completion_tokens"] == rec["completion_tokens"]
    # Everything settled once, billing what its stream carried; nothing left behind.
    assert {o.rid for o in first} == set(records)
    for rid, rec in records.items():
        assert rec["completion_tokens"] == res["stream_tokens"][rid]
    assert not any(res["leftovers"].values()), res["leftovers"]
    assert res["gw2_alive"]
    # The ones nobody came back for were cancelled in the engine, not run to max_tokens.
    abandoned = [records[o.rid] for o in first if o not in res["resumers"]]
    assert {(x["status"], x["error_code"]) for x in abandoned} == {("cancelled", "gateway_lost")}
    assert all(x["completion_tokens"] < MAX_TOKENS for x in abandoned)
    assert res["abandoned_settled_after"] < GW_DEAD_AFTER + 3.0
    # and the resumed ones were not (a live gateway relays them).
    assert all(records[o.rid]["status"] == "ok" for o in res["resumers"])
