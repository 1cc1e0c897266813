"""The per-pool circuit breaker (serving/health.py, serving/lua/breaker.lua B1-B4) on real Redis.

Times are passed as ``now`` so the cooldown and probe windows are exact, not slept through.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from infra.redis_conn import new_redis, pool_key
from serving import health
from serving.lua import script
from tests.procs import arun

P = "brk"
T0 = 1_000_000.0


@pytest.fixture
def breaker(redis_client, settings):
    settings.BREAKER_FAILURES = 3
    settings.BREAKER_COOLDOWN_SECONDS = 5.0
    settings.BREAKER_PROBE_SECONDS = 10.0
    settings.WORKER_DEAD_AFTER_SECONDS = 2.0
    return redis_client


def beat(r, pool: str = P, at: float = T0, wid: str = "w1") -> None:
    r.zadd(pool_key("workers", pool), {wid: at})


def allow(pool: str = P, at: float = T0) -> health.Verdict:
    return arun(health.check([pool], now=at))[0]


def test_no_live_worker_refuses_at_once_and_a_worker_closes_it(breaker):
    v = allow()
    assert (v.allowed, v.state, v.reason) == (False, "open", "no_worker")
    beat(breaker, at=T0 - 10)  # a heartbeat older than WORKER_DEAD_AFTER_SECONDS: still dead
    assert not allow().allowed
    beat(breaker, at=T0 - 1)
    v = allow()
    assert (v.allowed, v.state) == (True, "closed")


def test_consecutive_failures_open_it_and_a_success_resets_the_count(breaker):
    beat(breaker)
    for _ in range(2):
        arun(health.record(P, ok=False, now=T0))
    arun(health.record(P, ok=True, now=T0))  # not consecutive any more
    for _ in range(2):
        assert arun(health.record(P, ok=False, now=T0)).state == "closed"
    assert allow().allowed
    v = arun(health.record(P, ok=False, now=T0))
    assert (v.state, v.reason) == ("open", "failures")
    assert not allow(at=T0 + 4.9).allowed


def test_half_open_lets_exactly_one_probe_through_per_window(breaker):
    beat(breaker, at=T0 + 100)
    for _ in range(3):
        arun(health.record(P, ok=False, now=T0))
    verdicts = [allow(at=T0 + 5.0) for _ in range(5)]
    assert [v.allowed for v in verdicts] == [True, False, False, False, False]
    assert verdicts[0].state == "half_open"
    # The probe was lost (no outcome recorded): another one after the probe window.
    assert allow(at=T0 + 15.1).allowed
    assert not allow(at=T0 + 15.2).allowed
    # A failed probe opens it again for a whole cooldown.
    assert arun(health.record(P, ok=False, now=T0 + 16)).state == "open"
    assert not allow(at=T0 + 20.9).allowed
    assert allow(at=T0 + 21.0).allowed
    assert arun(health.record(P, ok=True, now=T0 + 21)).state == "closed"
    assert all(allow(at=T0 + 22).allowed for _ in range(3))


def test_concurrent_gateways_get_one_probe_between_them(breaker):
    """B3 under contention: 8 clients (separate connections, as separate gateways would be)
    ask at once in a half-open window; exactly one gets the probe."""
    beat(breaker, at=T0 + 100)
    for _ in range(3):
        arun(health.record(P, ok=False, now=T0))
    lua = script("breaker")
    got: Counter[int] = Counter()
    lock = threading.Lock()
    start = threading.Barrier(8)

    def ask() -> None:
        client = new_redis()
        start.wait()
        for _ in range(25):
            raw = lua.run(client, health._keys(P), health._args("allow", T0 + 6.0))
            with lock:
                got[int(raw[0])] += 1

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got[1] == 1 and got[0] == 199


def test_pools_are_independent_and_checked_in_one_call(breaker):
    beat(breaker, "a")
    beat(breaker, "b")
    for _ in range(3):
        arun(health.record("a", ok=False, now=T0))
    verdicts = arun(health.check(["a", "b", "c"], now=T0 + 1))
    assert [(v.pool, v.allowed) for v in verdicts] == [("a", False), ("b", True), ("c", False)]
    assert [v.reason for v in verdicts] == ["failures", "", "no_worker"]
    assert arun(health.live_workers(["a", "c"], now=T0)) == {"a": 1, "c": 0}


def test_only_pool_faults_count():
    assert health.counts_against_pool("worker_lost", True)
    assert not health.counts_against_pool("engine_refused", False)
    assert not health.counts_against_pool("client_disconnect", True)
    assert not health.counts_against_pool("engine_error", False)



def test_a_pools_successes_are_written_once_per_window_and_a_failure_after_the_waiting_one(
        monkeypatch):
    """``note``: a pool's first success is written at once, the ones after it within
    SUCCESS_EVERY_S as one write at the window's end; a failure goes at once, after the
    success still waiting (this process's order is kept); pools are independent."""
    writes: list[tuple[str, bool]] = []

    async def record(pool: str, ok: bool, now: float | None = None) -> None:
        writes.append((pool, ok))

    monkeypatch.setattr(health, "record", record)
    monkeypatch.setattr(health, "SUCCESS_EVERY_S", 0.05)

    async def run() -> None:
        for _ in range(5):
            health.note("a", True)
        health.note("b", True)
        await asyncio.sleep(0.01)
        assert writes == [("a", True), ("b", True)]
        await asyncio.sleep(0.08)
        assert writes == [("a", True), ("b", True), ("a", True)]  # the four waiting, as one
        health.note("a", True)  # within the window of the write just made: waits
        health.note("a", False)
        await asyncio.sleep(0.01)
        assert writes[3:] == [("a", True), ("a", False)]
        await asyncio.sleep(0.08)
        assert len(writes) == 5  # nothing was left waiting for the window's end

    arun(run())
