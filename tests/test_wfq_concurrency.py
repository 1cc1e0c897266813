"""Concurrent enqueue, remove and dispatch on real Redis: nothing is dispatched twice or lost.

Separate processes, each with its own connection, race against each other the way gateway
processes (enqueue, cancel) and pool workers (dispatch) do. Afterwards every request id must
be in exactly one place: removed by its producer, or in exactly one worker's in-flight set.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time

import pytest
import redis
import redis.asyncio as aioredis

from infra.redis_conn import redis_url
from serving.keys import inflight_key
from serving.wfq import AsyncWfq, Prices, Wfq
from tests.test_wfq_properties import assert_pool_consistent

POOL = "race"
PRICES = Prices(1.0, 2.0)
TENANTS = [f"t{i}" for i in range(12)]
PRODUCERS, CONSUMERS, PER_PRODUCER = 3, 3, 400


def _wfq(url: str) -> Wfq:
    return Wfq(redis.Redis.from_url(url), prices=PRICES)


def produce(url: str, pi: int, results: mp.Queue) -> None:
    """Enqueue PER_PRODUCER requests; cancel some at once, racing the dispatchers."""
    wfq, rng = _wfq(url), random.Random(pi)
    enqueued, removed = [], []
    for j in range(PER_PRODUCER):
        tenant, rid = rng.choice(TENANTS), f"p{pi}-{j}"
        wfq.enqueue(POOL, tenant, rid, weight=1 + TENANTS.index(tenant) % 3,
                    prompt_tokens=rng.randint(1, 2000), max_output_tokens=rng.randint(0, 500),
                    kv_tokens=rng.randint(1, 1000))
        enqueued.append((tenant, rid))
        if rng.random() < 0.2:
            tenant, rid = rng.choice(enqueued)
            if wfq.remove(POOL, tenant, rid):
                removed.append(rid)
    results.put(("producer", [r for _, r in enqueued], removed))


def consume(url: str, ci: int, producers_done, results: mp.Queue) -> None:
    """Dispatch (one at a time and in batches) until the producers are done and all is taken."""
    wfq, rng, worker = _wfq(url), random.Random(100 + ci), f"w{ci}"
    got: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        finished = producers_done.is_set()  # read before dispatching, so an empty reply is final
        items = wfq.dispatch_many(POOL, n=rng.choice([1, 1, 4]), free_slots=4,
                                  free_kv_tokens=rng.choice([500, 4000]), worker_id=worker)
        got += [i.request_id for i in items]
        if not items and finished and not wfq.backlog(POOL):
            break
    results.put(("consumer", worker, got))


@pytest.mark.slow
def test_processes_never_double_dispatch_or_lose_a_request(redis_client):
    url = redis_url()
    Wfq(redis_client).reset(POOL)
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()
    producers_done = ctx.Event()
    producers = [ctx.Process(target=produce, args=(url, i, results)) for i in range(PRODUCERS)]
    consumers = [ctx.Process(target=consume, args=(url, i, producers_done, results))
                 for i in range(CONSUMERS)]
    for p in consumers + producers:
        p.start()
    replies = [results.get(timeout=90) for _ in range(PRODUCERS)]
    producers_done.set()
    replies += [results.get(timeout=90) for _ in range(CONSUMERS)]
    for p in consumers + producers:
        p.join(timeout=10)
        assert p.exitcode == 0

    enqueued = [r for kind, ids, _ in replies if kind == "producer" for r in ids]
    removed = [r for kind, _, ids in replies if kind == "producer" for r in ids]
    by_worker = {w: ids for kind, w, ids in replies if kind == "consumer"}
    dispatched = [r for ids in by_worker.values() for r in ids]

    assert len(enqueued) == len(set(enqueued)) == PRODUCERS * PER_PRODUCER
    assert len(dispatched) == len(set(dispatched)), "a request was dispatched twice"
    assert set(dispatched).isdisjoint(removed), "a request was both removed and dispatched"
    assert sorted(dispatched + removed) == sorted(enqueued), "a request was lost"
    assert len(by_worker) == CONSUMERS and all(by_worker.values())
    for worker, ids in by_worker.items():  # what each worker got is exactly its in-flight set
        members = {m.decode() for m in redis_client.smembers(inflight_key(POOL, worker))}
        assert members == set(ids)
    assert assert_pool_consistent(redis_client, POOL) == {}


def test_asyncio_tasks_on_separate_connections_never_double_dispatch(redis_client):
    async def scenario() -> tuple[list[str], list[str]]:
        clients = [aioredis.Redis.from_url(redis_url()) for _ in range(4)]
        wfqs = [AsyncWfq(c, prices=PRICES) for c in clients]
        done = asyncio.Event()

        async def produce_async(k: int) -> list[str]:
            ids = [f"a{k}-{j}" for j in range(150)]
            for j, rid in enumerate(ids):
                await wfqs[k % 2].enqueue(POOL, TENANTS[j % 5], rid, weight=1 + j % 2,
                                          prompt_tokens=10 + j, max_output_tokens=5,
                                          kv_tokens=1)
            return ids

        async def consume_async(k: int) -> list[str]:
            got: list[str] = []
            while True:
                finished = done.is_set()
                items = await wfqs[2 + k].dispatch_many(POOL, n=1 + k * 3, free_slots=8,
                                                        free_kv_tokens=100, worker_id=f"aw{k}")
                got += [i.request_id for i in items]
                if not items and finished:
                    return got
                await asyncio.sleep(0)

        consumers = [asyncio.create_task(consume_async(k)) for k in range(2)]
        produced = await asyncio.gather(*(produce_async(k) for k in range(4)))
        done.set()
        taken = await asyncio.gather(*consumers)
        for c in clients:
            await c.aclose()
        return [r for ids in produced for r in ids], [r for ids in taken for r in ids]

    Wfq(redis_client).reset(POOL)
    enqueued, dispatched = asyncio.run(scenario())
    assert len(dispatched) == len(set(dispatched))
    assert sorted(dispatched) == sorted(enqueued)
    assert assert_pool_consistent(redis_client, POOL) == {}
