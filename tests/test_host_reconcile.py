"""A live worker settles what Redis says it runs and it does not (EngineHost._sweep).

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

import pytest

from infra.redis_conn import key
from serving import admission
from serving.keys import inflight_key
from serving.wire import SamplingParams
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
    # Queued, its prompt in transit: the host dispatches and runs this one itself.
    admit("served", out=5, sampling=SamplingParams(max_tokens=3))
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


def test_a_cancel_whose_message_was_missed_still_stops_the_sequence(
        redis_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """I5's backstop (EngineHost._sweep): the worker hears no PUBLISH at all (its
    listener is down, as while it reconnects), and a running request's cancel flag is set the
    way cancel.lua sets it. The sequence still stops within a sweep, settled cancelled and
    billed only for what was generated; without the sweep it would run all 5,000 tokens."""
    r = redis_client

    async def deaf(_host: EngineHost) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(EngineHost, "_cancel_listener", deaf)
    admit("long", out=5000, sampling=SamplingParams(max_tokens=5000, ignore_eos=True))
    engine = SimulatedEngine(SimConfig(max_running_seqs=4, kv_cache_tokens=16384,
                                       max_model_len=8192, decode_tokens_per_s=200.0))
    host = EngineHost(EngineSpec("jp", max_sequences=4), engine, "rw-2", heartbeat_s=0.1,
                      dead_after_s=5)

    async def main() -> None:
        task = asyncio.create_task(host.run())
        try:
            await until(lambda: r.xlen(rkeys.stream_key("jp", "long")) > 0)
            # cancel.lua with no channel: the flag, and no message to any worker.
            assert await admission.mark_cancel_async("jp", "long", "client_disconnect")
            await until(lambda: rkeys.usage_records(r))
        finally:
            host.request_stop()
            await task

    asyncio.run(main())
    [record] = rkeys.usage_records(r)
    assert record["status"] == "cancelled" and record["error_code"] == "client_disconnect"
    # Stopped within a sweep (1 s at 200 tokens/s, with margin), not run to the end.
    assert 0 < record["completion_tokens"] < 1000, record
    assert r.scard(inflight_key("jp", "rw-2")) == 0
    assert not any(counters(r).values()), counters(r)
