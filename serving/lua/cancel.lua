-- cancel.lua: flag a request as cancelled and say where it is.
--
-- KEYS[1] req:{rid}   ARGV[1] reason
-- Returns {0, state} when there is nothing to cancel (unknown or settled), otherwise
-- {1, state, pool, tenant}. The flag is written before the caller removes the request from its
-- queue or publishes on cancel:{pool}; dispatch.lua's claim reads it, so a worker that takes the request
-- between those steps still sees the cancel (no lost cancel in either order).

local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'settled' then return {0, st or 'unknown'} end
redis.call('HSETNX', KEYS[1], 'cancel', ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'pool', 'tenant')
return {1, st, v[1] or '', v[2] or ''}
