-- complete: correct a tenant's tags once the real cost of a request is known.
-- KEYS: the eight common keys, q(tenant), inflight(worker) (the last one unused
--       when request_id is '': the caller then guarantees exactly-once itself)
-- ARGV: tenant, estimated cost, actual cost, weight, request_id or ''
-- Returns the tenant's new last tag, or nil when request_id was given and was not in flight
-- on that worker (already completed): membership in the in-flight set is the once-only token.
--
-- The tag was computed with max_tokens as output. The difference / weight moves the tenant
-- in virtual time, so it is charged for what it was served, as Sheng et al.'s virtual token
-- counter counts tokens actually served. Every request still queued for the tenant was queued
-- behind this one (a tenant's queue is FIFO), so all of them move (shift_queue in common.lua);
-- with none queued, the correction reaches the tenant's next enqueue (move_last).
local q, inflight = KEYS[9], KEYS[10]
local tenant, rid = ARGV[1], ARGV[5]
local est, actual, weight = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not (est and actual and weight) or weight <= 0 then
  return redis.error_reply('WFQARG costs and weight must be numbers, weight > 0')
end
if rid ~= '' and redis.call('SREM', inflight, rid) == 0 then return nil end
local delta = (actual - est) / weight
if redis.call('EXISTS', q) == 1 then
  return fmt(shift_queue(q, tenant, delta, pool_policy()))
end
return fmt(move_last(tenant, delta))
