-- enqueue: append a request to its tenant's queue with a virtual finish tag.
-- KEYS: the eight common keys, q(tenant)
-- ARGV: policy, tenant, request_id, cost, weight, kv_tokens, now ('' = the Redis server's clock)
-- Returns the finish tag (string), or an error WFQDUP if the id is already queued.
-- Tag rule (Demers, Keshav, Shenker): finish = max(tenant's last tag, vtime) + cost / weight.
-- It also records when the tenant last enqueued and its weight (seen, weights, active: H6,
-- H7), which dispatch's slot fairness reads to know who is active.
-- Cost: O(log tenants + log queue length).
local q = KEYS[9]
local policy, tenant, rid = ARGV[1], ARGV[2], ARGV[3]
local cost, weight, kv = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if not (cost and weight and kv) or cost < 0 or weight <= 0 or kv < 0 then
  return redis.error_reply('WFQARG cost, weight and kv_tokens must be numbers, weight > 0')
end
local now = clock(ARGV[7])  -- before any write (TIME)
if not now then return redis.error_reply('WFQARG now must be a number') end
local err = claim_policy(policy)
if err then return err end
if redis.call('HEXISTS', items, rid) == 1 then
  return redis.error_reply('WFQDUP request ' .. rid .. ' is already queued')
end

local vtime = get_vtime()
local start = math.max(tonumber(redis.call('HGET', last, tenant) or '0'), vtime)
local finish = start + cost / weight
local off = get_shift(tenant)  -- 0 unless the tenant is backlogged (H5)
local seq = redis.call('HINCRBY', state, 'seq', 1)
local item = {arrival = vtime, cost = cost, weight = weight, kv = kv, seq = seq,
              tenant = tenant, rid = rid}
local entry = pack(finish - off, start - off, item)

redis.call('HSET', last, tenant, fmt(finish))
redis.call('ZADD', q, seq, entry)
redis.call('HSET', items, rid, entry)
redis.call('ZADD', seen, fmt(now), tenant)  -- H6: one member per tenant, latest time
redis.call('HSET', weights, tenant, fmt(weight))
activate(tenant, weight)  -- H7
if redis.call('ZCARD', q) == 1 then  -- the tenant just became backlogged (H1)
  redis.call('ZADD', heads, head_score(parse(entry), off, policy), tenant)
end
return fmt(finish)
