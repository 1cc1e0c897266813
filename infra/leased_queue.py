"""A Redis list drained in batches by one holder of a lease at a time, losing and duplicating
nothing (the usage writer and the content-log drain both use it).

- ``acquire`` takes the lease (SET NX PX with a random token); only its holder claims or deletes,
  and each claim and delete checks the token inside its Lua script, so a holder whose lease lapsed
  (a long pause, a slow commit) cannot remove what the next holder took.
- ``claim`` moves a batch from the pending list to a processing list in one script. If a crashed
  holder left a batch there, that batch comes back first: the write is idempotent on the
  database side (unique keys), so re-writing it is safe and dropping it never happens.
- ``release`` deletes the processing list after the batch is committed.
- ``extend`` renews the lease only for the token that holds it, so a holder whose lease lapsed
  cannot lengthen the next holder's lease (and keep working as if it were still its own).

Every script runs by EVALSHA (redis-py ``Script``): the body crosses the network once per
connection's server, not on every call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

# KEYS: pending, processing, lease   ARGV: token, n
_CLAIM = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return false end
local out = redis.call('LRANGE', KEYS[2], 0, -1)
if #out > 0 then return out end
for i = 1, tonumber(ARGV[2]) do
  local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not item then break end
  out[#out + 1] = item
end
return out
"""
# KEYS: processing, lease   ARGV: token. Drops the committed batch, only under the lease.
_RELEASE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
# KEYS: lease   ARGV: token. Gives the lease back if still ours.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease   ARGV: token, ms. Renews the lease only if still ours.
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def _run(client: Any, source: str, keys: list[str], args: list[Any]) -> Any:
    # register_script makes a redis-py Script (its SHA1 computed here); calling it sends
    # EVALSHA, and loads the body once if the server has not seen it.
    return client.register_script(source)(keys=keys, args=args)


@dataclass(frozen=True)
class Lease:
    """A lock with a random token that expires on its own; only the token's holder may renew
    or give it back."""

    key: str
    ms: int = 60_000

    def acquire(self, client: Any) -> str | None:
        """A token, or None while another holder has the lease."""
        token = uuid.uuid4().hex
        return token if client.set(self.key, token, nx=True, px=self.ms) else None

    def extend(self, client: Any, token: str) -> bool:
        """Renew for another ``ms``; False (and nothing changed) if the lease is not ours."""
        return bool(_run(client, _EXTEND, [self.key], [token, self.ms]))

    def unlock(self, client: Any, token: str) -> None:
        _run(client, _UNLOCK, [self.key], [token])


@dataclass(frozen=True)
class LeasedQueue:
    pending: str
    processing: str
    lease: str
    lease_ms: int = 60_000

    @property
    def _lease(self) -> Lease:
        return Lease(self.lease, self.lease_ms)

    def acquire(self, client: Any) -> str | None:
        """A lease token, or None while another holder has the lease."""
        return self._lease.acquire(client)

    def claim(self, client: Any, token: str, n: int) -> list[bytes]:
        """The leftover batch if there is one, else up to n new items; [] without the lease."""
        keys = [self.pending, self.processing, self.lease]
        return _run(client, _CLAIM, keys, [token, n]) or []

    def release(self, client: Any, token: str) -> bool:
        """Forget the committed batch; False if the lease was lost (the next holder re-writes)."""
        return bool(_run(client, _RELEASE, [self.processing, self.lease], [token]))

    def extend(self, client: Any, token: str) -> bool:
        """Renew the lease if ``token`` still holds it; False if it was lost meanwhile."""
        return self._lease.extend(client, token)

    def unlock(self, client: Any, token: str) -> None:
        self._lease.unlock(client, token)
