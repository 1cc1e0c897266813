-- open.lua: write an admitted request's state on its pool's slot (after admit.lua charged it).
--
-- KEYS[1] req:{p.POOL}:rid  KEYS[2] deadlines:{p.POOL} (zset)
-- ARGV[1] rid  ARGV[2] now in seconds ('' = Redis TIME)  ARGV[3] seconds until the backstop
-- settles it  ARGV[4..] field, value pairs stored in req (the charges and where they live)
-- Returns 1, or 0 when req already exists (a duplicate id: the caller releases its charge).
--
-- Invariant O1: the request's state and its deadline entry are written together, so every
-- request that can be dispatched can also be settled by the janitor's backstop.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local fields = {'state', 'queued', 'admitted_at', tostring(math.floor(now * 1000)),
                'delivered', '0'}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], string.format('%.3f', now + tonumber(ARGV[3])), ARGV[1])
return 1
