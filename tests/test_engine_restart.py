"""The host's engine watchdog: a dead engine is reported, restarted, and given up on.

An ``EngineHost`` runs in-process against real Redis with a simulated engine whose
``failure()`` can be switched on (what vLLM's engine does when its core process dies; the real
thing is killed in ``test_vllm_e2e.py``). Checked: the heartbeat says unhealthy with no capacity
while the engine is down, the engine is stopped and started again, and after
``max_engine_restarts`` the host leaves the pool and records why (the worker process then exits
non-zero, ``HostThread``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests import rkeys
from workers.engine.registry import EngineSpec
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import EngineHost


class DyingEngine(SimulatedEngine):
    def __init__(self) -> None:
        super().__init__(SimConfig(max_running_seqs=4, kv_cache_tokens=8192,
                                   max_model_len=2048))
        self.dead: str | None = None
        self.starts = 0
        self.stops = 0
        self.restart_delay = 0.0

    async def start(self) -> None:
        if self.starts:
            await asyncio.sleep(self.restart_delay)  # a real engine takes a while to load
        self.starts += 1
        self.dead = None
        await super().start()

    async def stop(self) -> None:
        self.stops += 1
        await super().stop()

    def failure(self) -> str | None:
        return self.dead


async def until(check: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def load_of(redis_client: Any, worker_id: str) -> dict[str, str]:
    raw = redis_client.hgetall(rkeys.worker_key("restart-pool", worker_id, "load"))
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_a_dead_engine_is_reported_unhealthy_and_restarted(redis_client: Any,
                                                           settings: Any) -> None:
    engine = DyingEngine()
    engine.restart_delay = 1.0
    host = EngineHost(EngineSpec("restart-pool", max_sequences=4), engine, "rw-1",
                      heartbeat_s=0.1, dead_after_s=5)
    seen: list[dict[str, str]] = []
    after: dict[str, str] = {}

    async def main() -> None:
        task = asyncio.create_task(host.run())
        await until(host.ready.is_set)
        await until(lambda: load_of(redis_client, "rw-1").get("healthy") == "1")
        engine.dead = "the engine core died"
        await until(lambda: engine.starts == 2 and host.engine_failure is None)
        await until(lambda: load_of(redis_client, "rw-1").get("healthy") == "1")
        after.update(load_of(redis_client, "rw-1"))
        host.request_stop()
        await task

    async def watch() -> None:
        while True:
            seen.append(load_of(redis_client, "rw-1"))
            await asyncio.sleep(0.05)

    async def both() -> None:
        watcher = asyncio.create_task(watch())
        try:
            await main()
        finally:
            watcher.cancel()

    asyncio.run(both())
    down = [s for s in seen if s.get("healthy") == "0"]
    assert down, "the heartbeat never said unhealthy"
    assert down[0]["max_running"] == "0"  # no capacity: the gateway routes elsewhere
    assert down[0]["engine_failure"] == "the engine core died"
    assert (after["engine_restarts"], after["max_running"]) == ("1", "4")
    assert engine.stops >= 2 and host.fatal is None  # stopped for the restart, then at the end


def test_past_its_restart_budget_the_host_leaves_the_pool_and_says_why(
        redis_client: Any, settings: Any) -> None:
    engine = DyingEngine()
    host = EngineHost(EngineSpec("restart-pool", max_sequences=4), engine, "rw-2",
                      heartbeat_s=0.1, dead_after_s=5, max_engine_restarts=1)

    async def main() -> None:
        task = asyncio.create_task(host.run())
        await until(host.ready.is_set)
        engine.dead = "first death"
        await until(lambda: engine.starts == 2 and host.engine_failure is None)
        engine.dead = "second death"
        await asyncio.wait_for(task, 10)  # run() returns by itself: the host gave up

    asyncio.run(main())
    assert host.fatal is not None and "second death" in str(host.fatal)
    assert engine.starts == 2
    assert redis_client.zscore(rkeys.workers_key("restart-pool"), "rw-2") is None  # left the pool
