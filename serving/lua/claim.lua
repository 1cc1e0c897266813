-- claim.lua: a worker takes a request the WFQ dispatcher handed it.
--
-- KEYS[1] req:{rid}
-- ARGV[1] worker id  ARGV[2] the worker's in-flight set  ARGV[3] now in seconds ('' = Redis TIME)
-- ARGV[4..] transit payload fields to hand over and delete
--
-- Invariant C1: only a 'queued' request can be claimed, and claiming flips it to 'running', so a
-- settled (cancelled, expired) request is never started and no request is started twice.
-- The payload (prompt ids, sampling, salt) is content in transit: it is deleted here, in the
-- step that hands it to the engine.

local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'queued' then return {0, st or 'unknown'} end
local now = tonumber(ARGV[3])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'inflight', ARGV[2],
           'dispatched_at', tostring(math.floor(now * 1000)))
local names = {}
for i = 4, #ARGV do names[#names + 1] = ARGV[i] end
local values = redis.call('HMGET', KEYS[1], unpack(names))
redis.call('HDEL', KEYS[1], unpack(names))
local out = {1, redis.call('HGET', KEYS[1], 'cancel') or ''}
for i = 1, #values do out[#out + 1] = values[i] or '' end
return out
