-- remove: drop a still-queued request (its client went away before dispatch).
-- KEYS: the eight common keys, q(tenant)
-- ARGV: tenant, request_id
-- Returns 1 if removed, 0 if it was not queued for this tenant (already dispatched,
-- removed, or another tenant's id: a tenant can never cancel someone else's request).
-- The tenant gets the removed cost / weight back. Removing the head moves the rest of its
-- queue up (they were all tagged behind it; shift_queue in common.lua); removing any other
-- request gives the credit to the tenant's next enqueue (move_last), because the requests
-- ahead of it must not move: otherwise queueing a large request and cancelling it would pull
-- the head forward.
local q = KEYS[9]
local tenant, rid, policy = ARGV[1], ARGV[2], pool_policy()
local entry = redis.call('HGET', items, rid)
if not entry then return 0 end
local item = parse(entry)
if item.tenant ~= tenant then return 0 end

local was_head = redis.call('ZRANK', q, entry) == 0
redis.call('ZREM', q, entry)
redis.call('HDEL', items, rid)
if was_head then repair_head(q, tenant, policy) end  -- H1
if was_head and redis.call('EXISTS', q) == 1 then
  shift_queue(q, tenant, -item.cost / item.weight, policy)
else
  move_last(tenant, -item.cost / item.weight)
end
return 1
