"""The exact-match response cache's storage: per tenant, in Redis, with a TTL and a size bound.

An entry is the answer to one deterministic request (the HTTP layer decides which:
``gateway.inference.cache``), stored under a hash of the request body and the tenant's id, on
the tenant's slot. ``cache_store.lua`` writes it and trims the tenant's index in one call
(invariants R1-R2 there). Nothing here is ever shared across tenants (I1): there is no key
without a tenant id in it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from django.conf import settings

from infra.redis_conn import get_async_redis, tenant_key
from serving.lua import script


@dataclass(frozen=True)
class Entry:
    model: str  # the model that served the original request
    pool: str
    pieces: list[str]  # the text deltas, as they were streamed
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def entry_key(tenant_id: int, digest: str) -> str:
    return tenant_key("rcache", tenant_id, "e", digest)


def index_key(tenant_id: int) -> str:
    return tenant_key("rcache", tenant_id, "idx")


async def get(tenant_id: int, digest: str) -> Entry | None:
    raw = await get_async_redis().get(entry_key(tenant_id, digest))
    if raw is None:
        return None
    try:
        return Entry(**json.loads(raw))
    except (TypeError, ValueError):
        return None  # an entry from another version: a miss, overwritten by the next store


async def put(tenant_id: int, digest: str, entry: Entry) -> bool:
    """Store; False when the entry is over ``RESPONSE_CACHE_MAX_ENTRY_BYTES`` (not cached)."""
    value = json.dumps(asdict(entry), separators=(",", ":"))
    if len(value) > settings.RESPONSE_CACHE_MAX_ENTRY_BYTES:
        return False
    await script("cache_store").run_async(
        get_async_redis(), [entry_key(tenant_id, digest), index_key(tenant_id)],
        [value, max(1, int(settings.RESPONSE_CACHE_TTL_SECONDS)), int(time.time() * 1000),
         settings.RESPONSE_CACHE_MAX_ENTRIES])
    return True
