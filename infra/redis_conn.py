"""One place that knows where Redis is, and hands out clients to it.

Sync clients serve Django views, Celery tasks and management commands; async clients serve the
ASGI hot path. Both are cached per process (and per event loop for async) so a request never pays
for a new connection.
"""

from __future__ import annotations

import os
from functools import lru_cache

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff

from infra.embedded_redis import ensure_embedded_redis
from infra.loop_local import LoopLocal


@lru_cache(maxsize=1)
def redis_url() -> str:
    if settings.REDIS_URL:
        return settings.REDIS_URL
    url = ensure_embedded_redis(settings.VAR_DIR)
    # Children (uvicorn workers, Celery) inherit the address rather than each probing for it.
    os.environ["REDIS_URL"] = url
    return url


@lru_cache(maxsize=1)
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(redis_url(), health_check_interval=30)


ASYNC_MAX_CONNECTIONS = 512
ASYNC_POOL_TIMEOUT_S = 10.0


def _new_async_client() -> aioredis.Redis:
    # A blocking pool: past ASYNC_MAX_CONNECTIONS a caller waits for a free connection.
    # redis-py's default async pool instead raises MaxConnectionsError at 100, which failed
    # requests (and worker settlements) whenever a burst had >100 Redis calls in flight.
    # A pool built this way gets no retry policy of its own (redis-py gives one only to
    # clients that build their pool): without it, the first command on a connection that a
    # Redis restart broke fails instead of reconnecting (seen as a 503 right after a restart).
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url(), max_connections=ASYNC_MAX_CONNECTIONS, timeout=ASYNC_POOL_TIMEOUT_S,
        health_check_interval=30,
        retry=AsyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3),
    )
    return aioredis.Redis(connection_pool=pool)


async_clients: LoopLocal[aioredis.Redis] = LoopLocal(_new_async_client)


def get_async_redis() -> aioredis.Redis:
    """An asyncio client bound to the running loop (clients cannot cross event loops).

    Keyed by the loop's id but checked against the loop itself: a new loop can reuse a closed
    loop's id and must not be handed that loop's dead connections (``LoopLocal``).
    """
    return async_clients.get()


def key(*parts: object) -> str:
    """A namespaced Redis key: ``key("bucket", tenant_id)`` -> ``igw:bucket:42``."""
    return ":".join([settings.REDIS_KEY_PREFIX, *(str(p) for p in parts)])
