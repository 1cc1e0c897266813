"""An idle worker looks at its pool's queue once per request, not once per event of it.

Each dispatch is ``dispatch.lua``, some 30 commands in Redis. A worker's own events (a slot
freed, a first token) can change a dispatch's answer only while requests are left queued
(``Dispatched.more``); before that rule an idle pool's worker ran about four dispatches per
request (the pop, a look right after it, one at the first token, one at the end), three of
which found nothing. An ``EngineHost`` runs in-process against real Redis with a simulated
engine; its dispatch calls are counted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from serving import admission as acc
from serving.wire import SamplingParams
from tests import rkeys
from tests.test_engine_restart import until
from tests.test_janitor import admission
from workers.engine.registry import EngineSpec
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import WAKE_TIMEOUT_S, EngineHost


def test_an_idle_worker_dispatches_once_per_request(redis_client: Any) -> None:
    r = redis_client
    engine = SimulatedEngine(SimConfig(max_running_seqs=4, kv_cache_tokens=8192,
                                       max_model_len=2048, decode_tokens_per_s=50.0))
    host = EngineHost(EngineSpec("jp", max_sequences=4), engine, "ww-1", heartbeat_s=0.1,
                      dead_after_s=5)
    calls: list[tuple[float, int]] = []  # (loop time, requests it got)

    async def main() -> float:
        task = asyncio.create_task(host.run())
        try:
            await until(lambda: host._wfq is not None)
            dispatch = host._wfq.dispatch_many

            async def counted(*args: Any, **kwargs: Any) -> Any:
                got = await dispatch(*args, **kwargs)
                calls.append((asyncio.get_running_loop().time(), len(got)))
                return got

            host._wfq.dispatch_many = counted
            for i in range(3):  # one at a time, each 10 tokens at 50/s: 0.2 s of decode
                rid = f"one-{i}"
                sampling = SamplingParams(max_tokens=10, ignore_eos=True)
                assert isinstance(await admission(rid, out=10, sampling=sampling), acc.Admitted)
                await until(lambda rid=rid: rid in {
                    rec["request_id"] for rec in rkeys.usage_records(r)})
            return asyncio.get_running_loop().time()
        finally:
            host.request_stop()
            await task

    ended = asyncio.run(main())
    assert sum(got for _, got in calls) == 3
    # The idle re-check (every WAKE_TIMEOUT_S, the safety net for a lost wake) comes on top.
    polls = (ended - calls[0][0]) / WAKE_TIMEOUT_S + 1
    empty = sum(1 for _, got in calls if not got)
    assert empty <= polls, (empty, polls, calls)
