-- prelude bucket: a token bucket's level now (admit.lua charges it, release.lua refunds it,
-- cell_share.lua moves its share). A bucket is a hash {level, ts[, share_rate, share_burst]}.
--
-- bucket_read(k, rate, burst, now) -> level, rate, burst, ts
--   A1  the level is refilled continuously at rate per minute since ts and capped at burst, so
--       it stays within [0, burst]; a clock that steps back refills nothing. A bucket never
--       written is full.
--   C1  a split tenant's bucket holds its cell's share (share_rate, share_burst, written by
--       cell_share.lua): it replaces the caller's rate and burst (docs/adr/0019).
local function bucket_read(k, rate, burst, now)
  local v = redis.call('HMGET', k, 'level', 'ts', 'share_rate', 'share_burst')
  if v[3] then rate, burst = tonumber(v[3]), tonumber(v[4]) end
  local level = tonumber(v[1])
  if not level then return burst, rate, burst, now end
  local ts = tonumber(v[2]) or now
  return math.min(burst, level + math.max(0, now - ts) * rate / 60), rate, burst, ts
end

local function bucket_write(k, level, ts)
  redis.call('HSET', k, 'level', string.format('%.6f', level), 'ts', string.format('%.6f', ts))
end
