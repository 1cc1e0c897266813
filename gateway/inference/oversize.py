"""Oversized prompts count against the tenant: repeated 400s for size become 429s.

A prompt refused for its size is free (nothing is admitted or charged), but measuring it is not:
reading, parsing and, under the size cap, tokenizing it costs the gateway CPU. So each such
refusal is counted in a per-tenant bucket in Redis; once a tenant has had
``OVERSIZE_REFUSALS_PER_MINUTE`` of them within the minute, its further requests are refused
with a 429 before their prompts are measured, until the minute is over.

Invariant: the count and its expiry change in one Lua script (INCR, and EXPIRE on the first
refusal of the window), so concurrent refusals on any number of gateway processes never lose
a count nor leave a bucket without an expiry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from gateway.inference.errors import ApiError, rate_limited
from infra.redis_conn import get_async_redis, key

WINDOW_S = 60
COUNTED = frozenset({"context_length_exceeded", "prompt_too_large"})
_COUNT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return n
"""


def _key(tenant_id: int) -> str:
    return key("oversize", tenant_id)


@dataclass(frozen=True)
class Count:
    """The tenant's count as a pipeline read it (``queue_count``; None: no refusal yet)."""
    raw: bytes | str | None


def queue_count(pipe: Any, tenant_id: int) -> None:
    """Add the read of the tenant's count to a pipeline (the router's: no round trip of its
    own, issue 30); pass its reply, as a ``Count``, to ``counted`` / ``check``."""
    pipe.get(_key(tenant_id))


async def check(tenant_id: int, read: Count | None = None) -> None:
    """429 while the tenant's oversize refusals within the window are at the limit. ``read``:
    the count read already, else it is read here."""
    client: Any = get_async_redis()
    count = read.raw if read is not None else await client.get(_key(tenant_id))
    if count is not None and int(count) >= settings.OVERSIZE_REFUSALS_PER_MINUTE:
        ttl = await client.ttl(_key(tenant_id))
        wait = float(ttl if ttl and ttl > 0 else WINDOW_S)
        raise rate_limited(
            "Too many oversized prompts from this tenant: try again in "
            f"{int(wait)} s with prompts that fit the model's context window.",
            code="too_many_oversized_prompts", retry_after=wait, headers={})


async def record(tenant_id: int) -> int:
    """Count one oversize refusal; returns the tenant's count in this window."""
    script: Any = get_async_redis().register_script(_COUNT)
    return int(await script(keys=[_key(tenant_id)], args=[WINDOW_S]))


@asynccontextmanager
async def counted(tenant_id: int, read: Count | None = None) -> AsyncIterator[None]:
    """Around measuring a prompt: refuse a tenant over the limit first, and count a refusal
    for size that comes out of the block. ``read``: as ``check``'s."""
    await check(tenant_id, read)
    try:
        yield
    except ApiError as exc:
        if exc.status == 400 and exc.code in COUNTED:
            await record(tenant_id)
        raise
