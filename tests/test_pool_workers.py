"""A pool's workers are read through infra.pool_workers (routing, shedding, metrics, status)."""

from __future__ import annotations

import time

from infra import pool_workers
from metering.keys import pool_names, pools_key


def test_live_workers_count_and_load_come_from_one_reader(redis_client, settings) -> None:
    now = time.time()
    stale = now - settings.WORKER_DEAD_AFTER_SECONDS - 5
    redis_client.zadd(pool_workers.workers_key("pw"), {"fresh": now - 1, "stale": stale})
    redis_client.hset(pool_workers.load_key("pw", "fresh"), mapping={"running": 3})
    pipe = redis_client.pipeline(transaction=False)
    pool_workers.queue_live_workers(pipe, "pw")
    pool_workers.queue_live_count(pipe, "pw")
    pool_workers.queue_load(pipe, "pw", b"fresh", "running", "waiting")
    live, count, load = pipe.execute()
    assert live == [b"fresh"]  # the stale heartbeat is a dead worker
    assert count == 1
    assert load == [b"3", None]


def test_pool_names_are_the_pools_set_sorted_as_text(redis_client) -> None:
    redis_client.sadd(pools_key(), "b-pool", "a-pool")
    assert pool_names(redis_client) == ["a-pool", "b-pool"]
