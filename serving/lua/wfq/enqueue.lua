-- enqueue: append a request to its tenant's queue with a virtual finish tag.
-- KEYS: the eight common keys, q(tenant)
-- ARGV: policy, tenant, request_id, cost, weight, kv_tokens, now ('' = the Redis server's clock)
-- Returns the finish tag (string), or an error WFQDUP if the id is already queued.
-- The work is enqueue_request in common.lua, which admission's pool-slot step (enter.lua)
-- runs too: a gateway admits through enter.lua; this script serves tools and simulations.
local a, err = enqueue_args(1)
if not a then return err end
local finish, seq = enqueue_request(KEYS[9], a.policy, a.tenant, a.rid, a.cost, a.weight, a.kv,
                                    a.now)
if not finish then return seq end
return fmt(finish)
