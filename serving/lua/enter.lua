-- enter.lua: admission's pool-slot step, after admit.lua charged the tenant's slot (ADR 0028):
-- write the request's state and backstop deadline (what open.lua did), queue it in its pool's
-- WFQ (enqueue.lua's work) and wake an idle worker, in one step on the pool's slot.
--
-- KEYS[1..8] the pool's eight WFQ keys (wfq/common.lua)  KEYS[9] q(tenant)
-- KEYS[10] req:{p.POOL}:rid  KEYS[11] deadlines:{p.POOL} (zset)  KEYS[12] wake:{p.POOL} (list)
-- ARGV[1] rid  ARGV[2] now in seconds ('' = Redis TIME)  ARGV[3] seconds until the backstop
-- settles it  ARGV[4..10] enqueue.lua's ARGV (policy, tenant, rid, cost, weight, kv, now)
-- ARGV[11..] field, value pairs stored in req (the charges and where they live)
-- Returns {1, finish tag, the pool's arrival number}; {0, 'duplicate'} when req already exists (the caller releases its
-- charge); a WFQ error (WFQDUP, WFQPOLICY, WFQARG) with nothing written but the policy.
--
-- Invariants:
--   O1  the request's state, its deadline entry and its queue entry are written together, so
--       every request that can be dispatched can also be settled by the janitor's backstop, and
--       every request whose state says 'queued' is in its queue or being cancelled.
--   O2  all or nothing: every refusal comes before the first write of req, deadlines or queue.
--   W1  the wake list is pushed in the same step as the queue entry, and capped (64), so an
--       idle worker's BLPOP returns once the request can be dispatched, and unread wakes never
--       pile up.
--! include wfq/common

local q, req, deadlines, wake = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
if redis.call('EXISTS', req) == 1 then return {0, 'duplicate'} end
local now = clock(ARGV[2])
local a, err = enqueue_args(4, ARGV[10] == '' and ARGV[2] == '' and now or nil)
if not a then return err end
local finish, seq = enqueue_request(q, a.policy, a.tenant, a.rid, a.cost, a.weight, a.kv, a.now)
if not finish then return seq end

local fields = {'state', 'queued', 'admitted_at', tostring(math.floor(now * 1000))}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', req, unpack(fields))
redis.call('ZADD', deadlines, string.format('%.3f', now + tonumber(ARGV[3])), ARGV[1])
redis.call('LPUSH', wake, '1')
redis.call('LTRIM', wake, 0, 63)
return {1, fmt(finish), seq}
