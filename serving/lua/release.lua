-- release.lua: give back a settled request's tenant-side charges, once (after settle.lua).
-- Every key is on the tenant's slot (ADR 0018).
--
-- KEYS[1] charges (zset: release tokens)  KEYS[2] charges:what (hash rid -> counter keys)
-- KEYS[3..6] token buckets: tenant input, tenant output, key input, key output
-- ARGV[1] rid  ARGV[2] now in seconds ('' = Redis TIME)
-- ARGV[3..6] amount to add back to each bucket (negative: charge the excess)
-- ARGV[7..14] rate per minute, burst for the four buckets (rate 0 = not limited)
-- KEYS[7..6+N] budget counters  ARGV[15] N, ARGV[16..15+N] what to give back to each (the
--   reservation minus the exact cost; negative charges an excess)
-- Returns 1 when it released, 0 when the token was already gone (released or pruned).
--
-- Invariants:
--   R1  once: removing the token is the first write, and nothing is written without it, so a
--       repeated or late release (and admit.lua's prune of an expired token) changes nothing.
--   R2  buckets stay within [0, burst] (refunds are capped, extra charges floor at 0) and each
--       counter admit.lua incremented is decremented once, never below zero.
--   B3  a budget counter gets back its request's unused reservation once (R1), never goes below
--       zero, and is not recreated once its period's counter expired (nothing left to refund).
--   C1  a split tenant's bucket is refilled and refunded at its cell's share (share_rate,
--       share_burst, written by cell_share.lua), as admit.lua charges it (docs/adr/0019).
--! include clock
--! include bucket

if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local now = clock(ARGV[2])
for i = 1, 4 do
  local delta = tonumber(ARGV[2 + i])
  local rate, burst = tonumber(ARGV[5 + 2 * i]), tonumber(ARGV[6 + 2 * i])
  if rate > 0 and delta ~= 0 then
    -- refilled up to now at the cell's share in force (C1), then the delta, capped (R2)
    local level, _, cap, ts = bucket_read(KEYS[2 + i], rate, burst, now)
    bucket_write(KEYS[2 + i], math.max(0, math.min(cap, level + delta)), math.max(now, ts))
  end
end
for b = 1, tonumber(ARGV[15] or '0') or 0 do
  local k, delta = KEYS[6 + b], tonumber(ARGV[15 + b])
  if delta ~= 0 and redis.call('EXISTS', k) == 1 then
    if redis.call('DECRBY', k, delta) < 0 then redis.call('SET', k, '0', 'KEEPTTL') end
  end
end
local what = redis.call('HGET', KEYS[2], ARGV[1]) or ''
for k in string.gmatch(what, '%S+') do
  if redis.call('DECR', k) < 0 then redis.call('SET', k, '0') end
end
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
