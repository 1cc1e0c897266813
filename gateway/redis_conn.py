"""One place that knows where Redis is, and hands out clients to it.

Sync clients serve Django views, Celery tasks and management commands; async clients serve the
ASGI hot path. Both are cached per process (and per event loop for async) so a request never pays
for a new connection.
"""

from __future__ import annotations

import asyncio
import os
from functools import lru_cache

import redis
import redis.asyncio as aioredis
from django.conf import settings


@lru_cache(maxsize=1)
def redis_url() -> str:
    if settings.REDIS_URL:
        return settings.REDIS_URL
    from gateway.embedded_redis import ensure_embedded_redis

    url = ensure_embedded_redis(settings.VAR_DIR)
    # Children (uvicorn workers, Celery) inherit the address rather than each probing for it.
    os.environ["REDIS_URL"] = url
    return url


@lru_cache(maxsize=1)
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(redis_url(), health_check_interval=30)


_async_clients: dict[int, aioredis.Redis] = {}


def get_async_redis() -> aioredis.Redis:
    """An asyncio client bound to the running loop (clients cannot cross event loops)."""
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = aioredis.Redis.from_url(redis_url(), health_check_interval=30)
        _async_clients[loop_id] = client
    return client


def key(*parts: object) -> str:
    """A namespaced Redis key: ``key("bucket", tenant_id)`` -> ``igw:bucket:42``."""
    return ":".join([settings.REDIS_KEY_PREFIX, *(str(p) for p in parts)])
