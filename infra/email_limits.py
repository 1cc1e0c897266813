"""How many emails a person can make the gateway send: password resets and invitations.

Without a limit anyone could make the gateway mail a victim's address over and over (a reset
form needs no account), or burn the sender's reputation. Each send is counted twice, per
recipient address and per requester (an IP address for the reset form, a user for
invitations), in fixed one-hour windows in Redis. One Lua script checks both counters and
counts only when both allow, so concurrent requests from several gateway processes can never
send more than the limits (invariant E1: at most ``limit`` sends per key per window).
"""

from __future__ import annotations

import hashlib

from infra.redis_conn import get_redis

WINDOW_S = 3600
PER_ADDRESS = 3  # a recipient gets at most 3 of a kind per hour
PER_REQUESTER = 10  # an IP or a user triggers at most 10 of a kind per hour

# KEYS: address counter, requester counter. ARGV: window, per-address, per-requester.
_SCRIPT = """
local a = tonumber(redis.call('GET', KEYS[1]) or '0')
local r = tonumber(redis.call('GET', KEYS[2]) or '0')
if a >= tonumber(ARGV[2]) or r >= tonumber(ARGV[3]) then return 0 end
for i = 1, 2 do
  if redis.call('INCR', KEYS[i]) == 1 then redis.call('EXPIRE', KEYS[i], ARGV[1]) end
end
return 1
"""


def _key(kind: str, what: str, value: str) -> str:
    # Hashed: addresses never appear in Redis in the clear. One hash slot per pair ({kind}).
    digest = hashlib.sha256(value.strip().lower().encode()).hexdigest()[:32]
    return f"emaillimit:{{{kind}}}:{what}:{digest}"


def allow_email(kind: str, address: str, requester: str) -> bool:
    """Count one email of ``kind`` to ``address`` asked by ``requester``; False (nothing
    counted) when either is over its hourly limit."""
    keys = [_key(kind, "to", address), _key(kind, "by", requester)]
    return bool(get_redis().eval(_SCRIPT, 2, *keys, WINDOW_S, PER_ADDRESS, PER_REQUESTER))
