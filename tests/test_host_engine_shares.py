"""What the engine host tells the dispatcher about its engine (rule E, docs/adr/0017).

A unit test of ``workers.host`` alone: the host's per-tenant prefill and KV bookkeeping, the
capacities it passes, and the priority it gives the engine, with the request's serving task
and wake-up replaced by no-ops (the live path is in test_worker_integration.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from serving.wire import SamplingParams, pack_prompt, pack_sampling
from workers.engine.registry import EngineSpec
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import EngineHost


def host_with(prefill: float = 20_000.0) -> EngineHost:
    engine = SimulatedEngine(SimConfig(prefill_tokens_per_s=prefill, kv_cache_tokens=100_000))
    host = EngineHost(EngineSpec("shares", kv_cache_tokens=100_000), engine)

    async def nothing(*_: Any) -> None:
        return None

    host._serve = nothing  # type: ignore[method-assign]
    host._slot_freed = asyncio.Event()
    return host


def test_host_counts_prompts_waiting_for_prefill_and_kv_held_per_tenant(settings) -> None:
    settings.WFQ_PREFILL_HORIZON_SECONDS = 2.0

    async def main() -> None:
        host = host_with()
        host._start("r1", 30_000, "a", 123.7)
        host._start("r2", 500, "b", 5.0)
        host._start("r3", 1_000, "a", 130.0)
        shares = host._engine_shares()
        assert (shares.prefill_capacity, shares.kv_capacity) == (40_000.0, 100_000.0)
        # Until the prompt is known, a request counts its kv_tokens as waiting for prefill.
        assert dict(shares.prefill) == {"a": 31_000, "b": 500}
        assert dict(shares.kv) == {"a": 31_000, "b": 500}
        host._set_pending(host.running["r1"], 29_000)  # its prompt, read after the claim
        host._set_pending(host.running["r3"], 0)  # its first token came: prefilled
        assert dict(host._engine_shares().prefill) == {"a": 29_000, "b": 500}
        host._freed("r1")
        host._freed("r2")
        assert dict(host._engine_shares().prefill) == {}
        assert dict(host._engine_shares().kv) == {"a": 1_000}
        host._freed("r3")
        assert not host._engine_shares().kv and not host._per_tenant

    asyncio.run(main())


def test_engine_priority_is_the_wfq_tag_unless_the_request_has_one() -> None:
    host = host_with()
    payload = {"prompt_ids": pack_prompt([5, 6, 7]),
               "sampling": pack_sampling(SamplingParams(max_tokens=4)).encode(),
               "salt": b"s", "priority": b"", "adapter": b""}
    assert host._engine_request("r", payload, tag=4_321.9).priority == 4_321
    assert host._engine_request("r", {**payload, "priority": b"-2"}, tag=9.0).priority == -2


class NoRateEngine(SimulatedEngine):
    """An engine that does not know its prefill rate (an upstream server, say)."""

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return None


def test_an_engine_without_a_prefill_rate_gets_kv_shares_only() -> None:
    host = EngineHost(EngineSpec("shares", kv_cache_tokens=100_000),
                      NoRateEngine(SimConfig(kv_cache_tokens=100_000)))
    # The KV cache bounds what can wait for prefill anyway: only the KV share binds.
    assert host._engine_shares().prefill_capacity == 100_000.0


def test_a_freed_slot_wakes_the_dispatch_loop_in_process() -> None:
    """A worker wakes its own dispatch loop with a local signal, not a Redis round trip: with
    no Redis at all, a freed slot ends the loop's wait well before its timeout."""
    from workers.host import WAKE_TIMEOUT_S

    async def main() -> None:
        host = host_with()
        host._redis = None  # any Redis call would fail
        host._work, host._idle = asyncio.Event(), asyncio.Event()
        host._start("r1", 10, "a", 1.0)
        waiting = asyncio.create_task(host._wait_for_work())
        await asyncio.sleep(0)
        assert host._idle.is_set()  # the pool's wake list is watched only while idle
        host._freed("r1")
        await asyncio.wait_for(waiting, WAKE_TIMEOUT_S / 5)
        assert not host._idle.is_set()

    asyncio.run(main())
