"""A Redis list drained in batches by one holder of a lease at a time, losing and duplicating
nothing (the usage writer and the content-log drain both use it).

- ``acquire`` takes the lease (SET NX PX with a random token); only its holder claims or deletes,
  and each claim and delete checks the token inside its Lua script, so a holder whose lease lapsed
  (a long pause, a slow commit) cannot remove what the next holder took.
- ``claim`` moves a batch from the pending list to a processing list in one script. If a crashed
  holder left a batch there, that batch comes back first: the write is idempotent on the
  database side (unique keys), so re-writing it is safe and dropping it never happens.
- ``release`` deletes the processing list after the batch is committed.
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


@dataclass(frozen=True)
class LeasedQueue:
    pending: str
    processing: str
    lease: str
    lease_ms: int = 60_000

    def acquire(self, client: Any) -> str | None:
        """A lease token, or None while another holder has the lease."""
        token = uuid.uuid4().hex
        return token if client.set(self.lease, token, nx=True, px=self.lease_ms) else None

    def claim(self, client: Any, token: str, n: int) -> list[bytes]:
        """The leftover batch if there is one, else up to n new items; [] without the lease."""
        return client.eval(_CLAIM, 3, self.pending, self.processing, self.lease, token, n) or []

    def release(self, client: Any, token: str) -> bool:
        """Forget the committed batch; False if the lease was lost (the next holder re-writes)."""
        return bool(client.eval(_RELEASE, 2, self.processing, self.lease, token))

    def extend(self, client: Any) -> None:
        client.pexpire(self.lease, self.lease_ms)

    def unlock(self, client: Any, token: str) -> None:
        client.eval(_UNLOCK, 1, self.lease, token)
