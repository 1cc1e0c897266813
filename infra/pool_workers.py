"""A pool's workers as their heartbeats show them: which are live, and each one's load.

Each worker heartbeats into ``workers:{p.P}`` (a zset, worker id -> time of its last beat) and
writes its load into ``worker:{p.P}:{wid}:load`` (a hash with a TTL: running, waiting,
in_flight, max_running, KV tokens, max_model_len, draining). A worker is live while its last
beat is newer than ``WORKER_DEAD_AFTER_SECONDS``. Routing, load shedding, the metrics, the pool
status page and ``manage.py serve`` read these keys only through here.

The readers pipeline their reads across pools, so the ``queue_*`` functions add a command to a
pipeline (sync or asyncio) and the caller executes it.
"""

from __future__ import annotations

import time

import redis
import redis.asyncio as aioredis
from django.conf import settings

from infra.keyspace import worker_key
from infra.keyspace import workers_key as workers_key  # re-exported: its readers' name
from infra.redis_conn import text

Pipeline = redis.client.Pipeline | aioredis.client.Pipeline


def load_key(pool: str, worker_id: bytes | str) -> str:
    """A worker's heartbeat load hash."""
    return worker_key(pool, text(worker_id), "load")


def live_since(now: float | None = None) -> float:
    """Workers whose last heartbeat is newer than this are live."""
    return (time.time() if now is None else now) - settings.WORKER_DEAD_AFTER_SECONDS


def queue_live_workers(pipe: Pipeline, pool: str, now: float | None = None) -> None:
    """Add to ``pipe``: the ids of the pool's live workers (a list of bytes)."""
    pipe.zrangebyscore(workers_key(pool), live_since(now), "+inf")


def queue_live_count(pipe: Pipeline, pool: str, now: float | None = None) -> None:
    """Add to ``pipe``: how many of the pool's workers are live (an int)."""
    pipe.zcount(workers_key(pool), live_since(now), "+inf")


def queue_load(pipe: Pipeline, pool: str, worker_id: bytes | str, *fields: str) -> None:
    """Add to ``pipe``: the named fields of a worker's load (a list, None where unset)."""
    pipe.hmget(load_key(pool, worker_id), list(fields))
