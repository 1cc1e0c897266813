"""The Redis keys of the usage pipeline: settlement pushes onto ``pending``, the writer drains it.

Separate from ``metering.writer`` so the serving core can name the queue it feeds without
importing the ORM. Settlement pushes a request's usage record in the script that settles it, on
the request's pool's slot (ADR 0018), so each pool has its own queue; the writer drains every
pool in ``pools_key()``.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from infra.keyspace import pools_key
from infra.redis_conn import key, pool_tag, tag, text

__all__ = ["pools_key"]  # re-exported: infra.keyspace owns it


def pool_names(r: redis.Redis) -> list[str]:
    """The pools in ``pools_key()``, sorted: what the janitor, the usage writer and the
    metrics walk."""
    return sorted(text(p) for p in r.smembers(pools_key()))


async def pool_names_async(r: aioredis.Redis) -> list[str]:
    """``pool_names`` for an asyncio client."""
    return sorted(text(p) for p in await r.smembers(pools_key()))


def pending_key(pool: str) -> str:
    """Usage records (JSON, counts only) that settlement pushed and no writer has claimed."""
    return key("usage", pool_tag(pool), "pending")


def processing_key(pool: str) -> str:
    return key("usage", pool_tag(pool), "processing")


def lease_key(pool: str) -> str:
    return key("usage", pool_tag(pool), "writer_lease")


def dead_key() -> str:
    return key("usage", "dead")


def dirty_hours_key() -> str:
    return key("usage", "dirty_hours")


def refusals_pending_key() -> str:
    """Refused requests (JSON, no content) the gateway pushed for the request log."""
    return key("reqlog", tag("q", "reqlog"), "pending")


def refusals_processing_key() -> str:
    return key("reqlog", tag("q", "reqlog"), "processing")


def refusals_lease_key() -> str:
    return key("reqlog", tag("q", "reqlog"), "lease")
