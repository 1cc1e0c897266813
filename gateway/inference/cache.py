"""The exact-match response cache, as the HTTP layer uses it (docs/adr/0025-response-cache.md).

Opt-in: the tenant's switch, the key's, or the request's header ``x-gateway-cache: use``.
``x-gateway-cache: bypass`` skips it for one request; ``refresh`` runs the request and stores
its answer in place of the old one. Only deterministic requests are cached (temperature 0, or a
seed), and only plain-text answers (no tools, logprobs or n > 1). The key is a hash of the
request body without the fields that do not change the answer (``stream``, ``user``...), and it
is per tenant (``serving.response_cache``): one tenant's answer is never served to another (I1).

A hit streams back at once in the same SSE shape (role, the stored deltas, finish, usage,
``[DONE]``) or as the same JSON body, with ``x-cache: hit``. It is metered like any request, as
a usage record with status ``cache_hit`` and model ``cache:{model}``: priced by the price
table's row for that name, which an operator sets (no row: free, so the default output cost of
a hit is zero). No admission runs for a hit: nothing reaches an engine.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from gateway.inference.choices import needs_assembler
from gateway.inference.requests import InferenceRequest
from infra.redis_conn import get_async_redis
from serving import response_cache
from serving.keys import usage_pending_key
from serving.response_cache import Entry
from tenants.auth import Principal

HEADER = "x-gateway-cache"
MODES = ("use", "bypass", "refresh")
# Fields that change nothing in the answer: the same request streamed or not is one entry.
NEUTRAL = frozenset({"stream", "stream_options", "user", "metadata", "store", "service_tier",
                     "fallbacks"})


def mode(principal: Principal, header: str | None, req: InferenceRequest) -> str | None:
    """``lookup``, ``refresh`` or None (not cached) for this request."""
    asked = (header or "").strip().lower()
    if asked == "bypass" or not (principal.response_cache or asked in ("use", "refresh")):
        return None
    if not deterministic(req) or needs_assembler(req):
        return None
    return "refresh" if asked == "refresh" else "lookup"


def deterministic(req: InferenceRequest) -> bool:
    return req.temperature == 0 or req.seed is not None


def digest(kind: str, data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k not in NEUTRAL and v is not None}
    raw = json.dumps([kind, body], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


async def meter_hit(principal: Principal, request_id: str, entry: Entry, *,
                    stream: bool) -> None:
    """One usage record for the hit, on the original pool's usage queue (the writer drains it
    with the others); counts only, as settle.lua writes them."""
    now = int(time.time() * 1000)
    record = {
        "request_id": request_id, "tenant_id": principal.tenant_id,
        "key_id": principal.key_id, "model": f"cache:{entry.model}", "pool": entry.pool,
        "prompt_tokens": entry.prompt_tokens, "cached_tokens": entry.prompt_tokens,
        "completion_tokens": entry.completion_tokens, "queue_wait_ms": 0, "ttft_ms": 0,
        "total_ms": 0, "status": "cache_hit", "finish_reason": entry.finish_reason,
        "error_code": None, "stream": stream, "admitted_at_ms": now, "settled_at_ms": now,
    }
    await get_async_redis().rpush(usage_pending_key(entry.pool),
                                  json.dumps(record, separators=(",", ":")))


__all__ = ["HEADER", "MODES", "Entry", "deterministic", "digest", "meter_hit", "mode",
           "response_cache"]
