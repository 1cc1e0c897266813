-- heartbeat.lua: a worker says it is alive and publishes its load.
--
-- KEYS[1] workers:{p.POOL}  KEYS[2] worker:{p.POOL}:wid:reaped  KEYS[3] worker:{p.POOL}:wid:load
-- ARGV[1] worker id  ARGV[2] pool  ARGV[3] load TTL seconds  ARGV[4..] load field, value pairs
-- (The pool joins the global ``pools`` set in a separate command: another slot, ADR 0018.)
--
-- Invariant H1: a worker the janitor has reaped never comes back under the same id. The reap
-- (reap_mark.lua) and this script both run atomically, so either the heartbeat lands first and
-- the reap sees a fresh score and stands down, or the reap lands first and this returns 0.
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], string.format('%.3f', now), ARGV[1])
if #ARGV >= 5 then
  local fields = {}
  for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', KEYS[3], 'updated_at', string.format('%.3f', now), unpack(fields))
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
end
return 1
