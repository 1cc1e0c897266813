-- cancel.lua: flag a request as cancelled, say where it is, and tell a running one's worker.
--
-- KEYS[1] req:{rid}   ARGV[1] reason   ARGV[2] the pool's cancel channel ('' = publish nothing)
-- ARGV[3] rid (the message's first field)
-- Returns {0, state} when there is nothing to cancel (unknown or settled), otherwise
-- {1, state, pool, tenant, published}: published is 1 when this script told the pool's workers
-- (state not 'queued'); a queued request is the caller's to remove from its queue, or, if a
-- worker took it meanwhile, to publish for (serving.submission.cancel_request).
--
-- Invariants:
--   C1  the flag is written before anyone is told or the caller removes the request from its
--       queue: dispatch.lua's claim reads it, so a worker that takes the request between
--       those steps still sees the cancel (no lost cancel in either order).
--   C2  a dispatched request's cancel is one step (flag + PUBLISH): one round trip for the
--       common case of a client leaving mid-stream (issue 30). PUBLISH carries no key, so it
--       may be sent from a script on any slot; Redis Cluster delivers it on every node.

local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'settled' then return {0, st or 'unknown'} end
redis.call('HSETNX', KEYS[1], 'cancel', ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'pool', 'tenant')
local published = 0
if st ~= 'queued' and ARGV[2] and ARGV[2] ~= '' then
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. '\t' .. ARGV[1])
  published = 1
end
return {1, st, v[1] or '', v[2] or '', published}
