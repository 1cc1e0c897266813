"""A live worker settles what Redis says it runs and it does not (EngineHost._reconcile).

Dispatch claims what it pops (dispatch.lua K1), so a dispatch whose reply is lost (the
connection dropped after the script ran: a failover, a network blip) leaves claimed requests in
the worker's in-flight set that nobody runs. The janitor reaps only dead workers' sets, so the
live worker must settle them itself (I4): a retryable ``worker_lost``, once, with the tenant's
concurrency given back. What it does run must be left alone.

An ``EngineHost`` runs in-process against real Redis with a simulated engine; the lost reply is
made with the same dispatch call a worker makes, whose answer is then dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from infra.redis_conn import key
from serving.keys import inflight_key, req_key
from serving.wire import SamplingParams, pack_prompt, pack_sampling
from tests import rkeys
from tests.test_engine_restart import until
from tests.test_janitor import admit, admit_and_dispatch, last_entry
from workers.engine.registry import EngineSpec
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import EngineHost


def counters(r: Any) -> dict[bytes, int]:
    return {k: int(r.get(k)) for pattern in ("conc:*", "streams:*") for k in r.keys(key(pattern))}


def test_a_claim_whose_reply_was_lost_is_settled_by_the_live_worker(redis_client: Any) -> None:
    r = redis_client
    admit_and_dispatch(r, "lost", "rw-1")  # claimed for rw-1, which never heard of it
    assert r.sismember(inflight_key("jp", "rw-1"), "lost")
    admit("served", out=5)  # queued: the host dispatches and runs this one itself
    r.hset(req_key("jp", "served"), mapping={  # its prompt in transit, as the gateway writes it
        "prompt_ids": pack_prompt([5, 6, 7]),
        "sampling": pack_sampling(SamplingParams(max_tokens=3))})
    engine = SimulatedEngine(SimConfig(max_running_seqs=4, kv_cache_tokens=8192,
                                       max_model_len=2048))
    host = EngineHost(EngineSpec("jp", max_sequences=4), engine, "rw-1", heartbeat_s=0.1,
                      dead_after_s=5)

    async def main() -> None:
        task = asyncio.create_task(host.run())
        try:
            await until(lambda: {"lost", "served"} <= {
                rec["request_id"] for rec in rkeys.usage_records(r)})
        finally:
            host.request_stop()
            await task

    asyncio.run(main())
    got = {rec["request_id"]: rec for rec in rkeys.usage_records(r)}
    assert got["lost"]["status"] == "error" and got["lost"]["error_code"] == "worker_lost"
    assert got["lost"]["completion_tokens"] == 0  # nothing was generated: nothing is billed
    assert last_entry(r, "lost")[b"e"] == b"worker_lost"  # its stream ends, retryably
    assert got["served"]["status"] == "ok" and got["served"]["error_code"] is None
    assert len(rkeys.usage_records(r)) == 2  # once each
    assert r.scard(inflight_key("jp", "rw-1")) == 0
    assert not any(counters(r).values()), counters(r)
