"""The router's pieces on real Redis (gateway/inference/routes.py): the weighted draw, the
tenant's expected wait per pool, and the choice across priorities and breakers. The whole path
on real processes: tests/test_routes_live.py."""

from __future__ import annotations

import random
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.inference.pools import ModelInfo, PoolInfo
from gateway.inference.routes import Router, Target, affinity_key, draw, expected_waits
from infra.redis_conn import pool_key
from serving import health
from tests.procs import arun

MODEL = ModelInfo("m", None, 4096, 0)


def target(pool: str, weight: float = 1.0, priority: int = 0) -> Target:
    return Target(PoolInfo(pool, "local", None, MODEL), weight, priority, "m")


def worker(r: Any, pool: str, wid: str, *, in_flight: int, max_running: int,
           waiting: int = 0) -> None:
    r.zadd(pool_key("workers", pool), {wid: time.time()})
    r.hset(pool_key("worker", pool, wid, "load"),
           mapping={"in_flight": in_flight, "max_running": max_running, "waiting": waiting})


def queue(r: Any, pool: str, tenant: str, n: int) -> None:
    for i in range(n):
        r.hset(pool_key("wfq", pool, "items"), f"{tenant}-{i}", "x")
        r.zadd(pool_key("wfq", pool, "q", tenant), {f"{tenant}-{i}": i})
    r.zadd(pool_key("wfq", pool, "active"), {tenant: 1_000_000})


def test_the_draw_follows_the_weights_when_waits_are_equal():
    rng = random.Random(7)
    picks = Counter(draw([target("a", 3.0), target("b", 1.0)], [0.0, 0.0], rng).pool.name
                    for _ in range(8000))
    assert abs(picks["a"] / picks["b"] / 3 - 1) < 0.05, picks


def test_the_draw_leans_away_from_a_long_wait_and_never_picks_an_infinite_one():
    rng = random.Random(7)
    picks = Counter(draw([target("a"), target("b")], [3.0, 0.0], rng).pool.name
                    for _ in range(4000))
    assert abs(picks["b"] / picks["a"] / 4 - 1) < 0.1, picks  # 1/(1+3) against 1/(1+0)
    assert all(draw([target("a"), target("b")], [float("inf"), 0.0], rng).pool.name == "b"
               for _ in range(200))


def test_a_prompt_cache_key_sticks_to_one_target_and_keys_still_split_by_weight():
    targets, waits = [target("a", 3.0), target("b", 1.0), target("c", 1.0)], [0.0, 0.0, 0.0]
    rng = random.Random(7)
    key = affinity_key(7, "conversation-42")
    first = draw(targets, waits, rng, key).pool.name
    assert all(draw(targets, waits, rng, key).pool.name == first for _ in range(200))
    keys = [affinity_key(7, f"k{i}") for i in range(6000)]
    before = {k: draw(targets, waits, rng, k).pool.name for k in keys}
    picks = Counter(before.values())
    # A target going away moves only the keys that picked it (rendezvous hashing).
    after = {k: draw(targets[:2], waits[:2], rng, k).pool.name for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")
    assert abs(picks["a"] / 6000 - 0.6) < 0.03 and abs(picks["b"] / picks["c"] - 1) < 0.15, picks
    # A long wait moves the keys away from a target, in proportion (1/(1+3) of its share).
    moved = Counter(draw(targets, [3.0, 0.0, 0.0], rng, k).pool.name for k in keys)
    assert abs(moved["a"] / 6000 - 0.75 / 2.75) < 0.03, moved
    assert affinity_key(7, None) is None and affinity_key(7, "") is None
    assert affinity_key(7, "k") != affinity_key(8, "k")  # scoped to the tenant (I1)


def test_the_router_passes_the_key_to_its_draw(router, redis_client):
    for pool in ("first", "second", "third"):
        worker(redis_client, pool, f"w-{pool}", in_flight=0, max_running=4)
    targets = [target("first"), target("second"), target("third")]
    sticky = Router("m", router.principal, prompt_cache_key="prefix-1")
    assert len({arun(sticky._pick_among(targets)).pool.name for _ in range(20)}) == 1
    assert len({arun(router._pick_among(targets)).pool.name for _ in range(60)}) > 1


def test_the_expected_wait_is_the_tenants_own(redis_client):
    worker(redis_client, "p1", "w1", in_flight=4, max_running=4)  # full
    worker(redis_client, "p2", "w2", in_flight=2, max_running=4)  # two free slots
    queue(redis_client, "p1", "7", 3)
    queue(redis_client, "p1", "8", 5)
    queue(redis_client, "p2", "8", 6)
    waits = arun(expected_waits([target("p1"), target("p2"), target("p3")], 7))
    # p1: min(8 queued, (3 + 1) x 2 active) = 8 ahead, no free slot: 8 / 4.
    # p2: tenant 7 has nothing queued: min(6, 1 x 1) = 1 ahead, 2 free: no wait.
    # p3: no live worker, no capacity: never.
    assert waits == [2.0, 0.0, float("inf")]
    # The other tenant, backlogged in p2, waits there: min(6, 7 x 1) - 2 free = 4 / 4.
    assert arun(expected_waits([target("p2")], 8)) == [1.0]


@pytest.fixture
def router(redis_client, settings):
    settings.BREAKER_FAILURES = 1
    principal = SimpleNamespace(tenant_id=7)
    return Router("m", principal)  # type: ignore[arg-type]


def test_a_lower_priority_is_used_only_when_every_higher_one_is_unhealthy(router, redis_client):
    for pool in ("first", "second", "spare"):
        worker(redis_client, pool, f"w-{pool}", in_flight=0, max_running=4)
    targets = [target("first", 1.0, 0), target("second", 1.0, 0), target("spare", 5.0, 1)]
    picked = {arun(router._pick_among(targets)).pool.name for _ in range(30)}
    assert picked == {"first", "second"}
    arun(health.record("first", ok=False))  # threshold 1: open
    redis_client.delete(pool_key("workers", "second"))  # no live worker
    assert arun(router._pick_among(targets)).pool.name == "spare"
    assert router.reasons == {"first": "circuit open", "second": "no live worker"}
    router.exclude(targets[2], "engine_error")
    assert arun(router._pick_among(targets)) is None


def test_the_pick_reads_overload_and_oversize_in_its_own_round_trip(router, redis_client,
                                                                    settings):
    """Issue 30: the checks between the pick and admission (overload shedding, the oversize
    count) come from the pick's pipeline; what it read is what a separate reading reads."""
    from gateway.inference import overload, oversize

    settings.SHED_QUEUE_FACTOR = 4
    for pool in ("a", "b"):
        worker(redis_client, pool, f"w-{pool}", in_flight=0, max_running=4)
    queue(redis_client, "a", "7", 3)
    redis_client.hset(pool_key("wfq", "a", "state"), "vtime", 10)
    redis_client.hset(pool_key("wfq", "a", "last"), "7", 25)
    redis_client.set(oversize._key(7), 5)
    arun(router._pick_among([target("a"), target("b")]))
    assert router.overload_readings["a"] == arun(overload.reading("a", 7)) == (3, 1, 15.0)
    assert router.overload_readings["b"] == (0, 1, 0.0)
    assert router.oversize_read == oversize.Count(b"5")
    settings.SHED_QUEUE_FACTOR = 0  # shedding off: nothing read for it
    arun(router._pick_among([target("a")]))
    assert router.overload_readings == {}
