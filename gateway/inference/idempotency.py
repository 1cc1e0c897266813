"""Idempotency-Key for non-streaming requests: replay, 409 while in flight, 422 on a new body.

State lives in Redis under ``idem:{tenant}:{sha256(key)}`` (a tenant's keys never meet another
tenant's) as a hash: state (inflight | done), the canonical body hash, the owner token, and once
done the stored status and body. Every transition is one Lua script, so two gateway processes
receiving the same key at once cannot both start the request. Invariants:

- At most one request per (tenant, key) is in flight: ``begin`` creates the entry only if absent.
- Only the owner's token can store a result or abandon the entry.
- An abandoned entry (a retryable failure: 429, 503) is deleted, so the client's retry runs.
- A stored result expires 24 hours after it was stored; an in-flight entry expires after the
  request's deadline, so a gateway that died mid-request does not block the key forever.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.inference.errors import ApiError, invalid_request
from infra.redis_conn import get_async_redis, key

RETENTION_S = 24 * 3600
MAX_KEY_LENGTH = 255

_BEGIN = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'hash', 'status', 'body')
if not cur[1] then
  redis.call('HSET', KEYS[1], 'state', 'inflight', 'hash', ARGV[1], 'owner', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'new'}
end
if cur[2] ~= ARGV[1] then return {'mismatch'} end
if cur[1] == 'inflight' then return {'inflight'} end
return {'done', cur[3], cur[4]}
"""
_FINISH = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], 'state', 'done', 'status', ARGV[2], 'body', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


@dataclass(frozen=True)
class Replay:
    status: int
    body: bytes


def _script(source: str) -> Any:
    """The script on this loop's client, run by EVALSHA (redis-py AsyncScript)."""
    return get_async_redis().register_script(source)


@dataclass
class Claim:
    redis_key: str
    owner: str

    async def store(self, status: int, body: bytes) -> None:
        await _script(_FINISH)(keys=[self.redis_key],
                               args=[self.owner, str(status), body, RETENTION_S])

    async def abandon(self) -> None:
        await _script(_FINISH)(keys=[self.redis_key], args=[self.owner, "", b"", 0])


def body_hash(data: dict[str, Any]) -> str:
    """Hash of the canonical body: the same JSON with other spacing or key order is the same."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def checked_key(value: str) -> str:
    if not value or len(value) > MAX_KEY_LENGTH or not value.isprintable():
        raise invalid_request(
            f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable characters.",
            param="Idempotency-Key", code="invalid_idempotency_key",
        )
    return value


async def begin(
    tenant_id: int, idem_key: str, digest: str, inflight_ttl_s: float
) -> Claim | Replay:
    """Claim the key for this request, or return what to answer instead (or raise 409/422)."""
    redis_key = key("idem", tenant_id, hashlib.sha256(idem_key.encode()).hexdigest())
    owner = uuid.uuid4().hex
    reply = await _script(_BEGIN)(keys=[redis_key],
                                  args=[digest, owner, int(inflight_ttl_s * 1000)])
    state = reply[0].decode()
    if state == "new":
        return Claim(redis_key, owner)
    if state == "mismatch":
        raise ApiError(422, "This Idempotency-Key was already used with a different request body.",
                       param="Idempotency-Key", code="idempotency_key_reused")
    if state == "inflight":
        raise ApiError(409, "A request with this Idempotency-Key is still in progress.",
                       param="Idempotency-Key", code="idempotency_key_in_use", retry_after=1)
    return Replay(int(reply[1]), bytes(reply[2]))
