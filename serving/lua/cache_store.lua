-- Store one exact-match response cache entry (serving/response_cache.py).
-- KEYS[1] rcache:{t.T}:e:<hash>   (string: the entry, with a TTL)
-- KEYS[2] rcache:{t.T}:idx        (zset: entry key -> stored at, ms)
-- ARGV: value, ttl (s), now (ms), max entries
--
-- Invariants (the only writer of these keys):
-- R1 keys are built from the tenant id and live on the tenant's slot: one tenant's lookup can
--    only ever read its own entries (I1).
-- R2 after every store the tenant holds at most `max entries` live entries: the index lists
--    every stored entry younger than its TTL, and the oldest are dropped, entry and index
--    together, in this same call.
local ttl, now, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl * 1000)
local over = redis.call('ZCARD', KEYS[2]) - cap
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do
    redis.call('DEL', old[i])
  end
end
redis.call('PEXPIRE', KEYS[2], ttl * 1000)
return 1
