"""One place that knows where Redis is, and hands out clients to it.

Sync clients serve Django views, Celery tasks and management commands; async clients serve the
ASGI hot path. Both are cached per process (and per event loop for async) so a request never pays
for a new connection.

With ``REDIS_SENTINELS`` set, every client reaches the master through Redis Sentinel: a
connection asks the sentinels where the master is, and one that finds it gone (refused, or
demoted to a read-only replica) is dropped and retried against the new master (ADR
"beyond-redis-sentinel").
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url
from redis.retry import Retry

from infra.embedded_redis import ensure_embedded_redis
from infra.loop_local import LoopLocal


def sentinel_mode() -> bool:
    return bool(settings.REDIS_SENTINEL_NODES)


@lru_cache(maxsize=1)
def redis_url() -> str:
    if settings.REDIS_URL:
        return settings.REDIS_URL
    if sentinel_mode():
        raise RuntimeError("Redis is reached through REDIS_SENTINELS: there is no single URL")
    url = ensure_embedded_redis(settings.VAR_DIR)
    # Children (uvicorn workers, Celery) inherit the address rather than each probing for it.
    os.environ["REDIS_URL"] = url
    return url


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(base=0.05, cap=1.0)


def _master_kwargs() -> dict[str, Any]:
    """db, username and password for the master: from REDIS_URL when it is set."""
    parsed: dict[str, Any] = (
        parse_url(settings.REDIS_URL) if settings.REDIS_URL else {}  # type: ignore[no-untyped-call]
    )
    return {k: parsed[k] for k in ("db", "username", "password") if parsed.get(k) is not None}


@lru_cache(maxsize=1)
def get_redis() -> redis.Redis:
    if sentinel_mode():
        # redis-py's Sentinel classes are unannotated, hence the ignores and casts below.
        sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            settings.REDIS_SENTINEL_NODES, socket_timeout=1.0)
        # Unlike from_url's, this client retries: a command that meets a failover (refused, or
        # the old master answering READONLY) reconnects to the master the sentinels name now.
        return cast(redis.Redis, sentinel.master_for(  # type: ignore[no-untyped-call]
            settings.REDIS_SENTINEL_MASTER, health_check_interval=30,
            retry=Retry(_backoff(), 3), **_master_kwargs()))
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
    options: dict[str, Any] = {"max_connections": ASYNC_MAX_CONNECTIONS,
                               "timeout": ASYNC_POOL_TIMEOUT_S, "health_check_interval": 30,
                               "retry": AsyncRetry(_backoff(), 3)}
    if sentinel_mode():
        return cast(aioredis.Redis, _async_sentinel().master_for(
            settings.REDIS_SENTINEL_MASTER, connection_pool_class=_BlockingSentinelPool,
            **options, **_master_kwargs()))
    pool = aioredis.BlockingConnectionPool.from_url(redis_url(), **options)
    return aioredis.Redis(connection_pool=pool)


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Finds the master through the sentinels, and waits for a free connection at the cap."""


def _async_sentinel() -> aiosentinel.Sentinel:
    return aiosentinel.Sentinel(  # type: ignore[no-untyped-call]
        settings.REDIS_SENTINEL_NODES, socket_timeout=1.0)


def new_async_pool(**options: Any) -> aioredis.ConnectionPool:
    """A separate asyncio pool (the stream relay's own blocking connection), Sentinel-aware.

    A Sentinel pool's connections refer to their pool weakly: keep the pool while they live.
    """
    if sentinel_mode():
        return aiosentinel.SentinelConnectionPool(  # type: ignore[no-untyped-call]
            settings.REDIS_SENTINEL_MASTER, _async_sentinel(), **options, **_master_kwargs())
    return aioredis.ConnectionPool.from_url(redis_url(), **options)


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
