-- Shared prelude, prepended to every WFQ script at load time (serving/wfq.py), and included by
-- settle.lua, which corrects the tenant's tags in the same step that settles.
--
-- Keys of one pool P (all under settings.REDIS_KEY_PREFIX); every script gets the first eight
-- as KEYS[1..8], in this order:
--   wfq:P:heads  zset  tenant -> head score    one member per backlogged tenant
--   wfq:P:items  hash  request id -> entry      every queued request, nothing else
--   wfq:P:state  hash  vtime, seq, policy,      virtual time, arrival counter, policy,
--                      active_w                 the sum of the active zset's scores (H7)
--   wfq:P:last   hash  tenant -> finish tag     tag of the tenant's latest enqueue, corrected
--   wfq:P:shift  hash  tenant -> offset         added to the tags stored in T's entries
--   wfq:P:seen   zset  tenant -> time           when T last enqueued (seconds, enqueuer's clock)
--   wfq:P:weight hash  tenant -> weight         the weight of T's latest enqueue
--   wfq:P:active zset  tenant -> weight units   T's weight in units of 1e-6 (integer), for
--                                               every tenant in seen or heads (H7)
--   wfq:P:q:T    zset  entry -> arrival seq    tenant T's queue, FIFO by seq
-- A queue entry packs what the dispatcher needs, so no per-request key exists:
--   finish|start|arrival|cost|weight|kv|seq|tenant|request_id
-- where arrival is the pool's vtime when the request was queued. The finish and start tags
-- stored in an entry are raw: the effective tag is raw + shift[T]. A correction moves all of
-- a tenant's queued tags at once by changing shift[T] and its heads score: O(log tenants), no
-- re-tagging. shift[T] is dropped when T's queue empties.
--
-- Invariants every script keeps (tests/test_wfq_properties.py checks them after each step):
--   H1 a tenant is in heads iff its queue is non-empty, scored by its head entry
--      (effective finish tag under "wfq", arrival seq under "fifo");
--   H2 items holds exactly the entries of all queues, one per request id;
--   H3 a request id is in at most one place: a queue (and items) or a worker's in-flight
--      set; dispatch moves it from one to the other in the same script;
--   H4 vtime never decreases;
--   H5 shift has an entry only for backlogged tenants;
--   H6 seen, weight and active only steer how many of a worker's slots a tenant may hold
--      (dispatch's slot fairness): no request's place, tag or vtime depends on them. seen has
--      at most one member per tenant (its latest enqueue time); dispatch drops members older
--      than its activity window, so it holds only recently active tenants. weight, like last,
--      has one field per tenant that ever queued in the pool; reset deletes all three.
--   H7 active has a member exactly for each tenant in seen or heads, scored units(weight[T]),
--      and state's active_w is the sum of those scores: the pool's active tenants, their
--      weight sum and (the zset's last member) their largest weight, kept incrementally
--      (enqueue adds, a queue emptying outside the window or a window expiry outside heads
--      removes, a weight change adjusts), so dispatch reads them in O(log tenants) instead of
--      rebuilding the set. Integers, so the sum never drifts.
--
-- Numbers are Lua doubles. They go back to Redis as strings formatted with %.17g, because
-- Redis converts a bare Lua number with %.14g (losing digits) and truncates number replies.

local heads, items, state, last, shift = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local seen, weights, active = KEYS[6], KEYS[7], KEYS[8]

local function fmt(x)
  return string.format('%.17g', x)
end

local function parse(entry)
  local f, s, a, c, w, kv, seq, tenant, rid = string.match(entry,
    '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  return {finish = tonumber(f), start = tonumber(s), arrival = tonumber(a), cost = tonumber(c),
          weight = tonumber(w), kv = tonumber(kv), seq = seq, tenant = tenant, rid = rid}
end

local function pack(finish, start, item)
  return table.concat({fmt(finish), fmt(start), fmt(item.arrival), fmt(item.cost),
                       fmt(item.weight), fmt(item.kv), item.seq, item.tenant, item.rid}, '|')
end

-- Wall time in seconds: clock(arg), the caller's or the Redis server's.
--! include clock

local function get_vtime()
  return tonumber(redis.call('HGET', state, 'vtime') or '0')
end

local function get_shift(tenant)
  return tonumber(redis.call('HGET', shift, tenant) or '0')
end

local function head_score(item, off, policy)
  if policy == 'fifo' then return item.seq end
  return fmt(item.finish + off)
end

-- The pool's policy is stored with it: dispatch and remove follow it, whoever calls. Enqueue
-- may switch it only while nothing is queued, because one heads zset must not compare tags
-- with sequence numbers.
local function pool_policy()
  return redis.call('HGET', state, 'policy') or 'wfq'
end

local function claim_policy(policy)
  local stored = redis.call('HGET', state, 'policy')
  if stored == policy then return nil end
  if stored and redis.call('ZCARD', heads) > 0 then
    return redis.error_reply('WFQPOLICY pool has requests queued under ' .. stored ..
                             ', not ' .. policy)
  end
  redis.call('HSET', state, 'policy', policy)
  return nil
end

-- H7. A weight in integer units of 1e-6 (at least 1), so active_w is an exact integer sum:
-- slot shares use weights rounded to 1e-6 (tier weights are >= 0.01).
local function units(weight)
  return math.max(1, math.floor(weight * 1e6 + 0.5))
end

local function int(x)
  return string.format('%d', x)
end

-- T entered seen (enqueue): add it to active, or adjust for a changed weight.
local function activate(tenant, weight)
  local new = units(weight)
  local old = tonumber(redis.call('ZSCORE', active, tenant) or '0')
  if old ~= new then
    redis.call('ZADD', active, int(new), tenant)
    redis.call('HINCRBY', state, 'active_w', int(new - old))
  end
end

-- T left seen or heads: drop it from active unless it is still in the other one.
local function deactivate(tenant, other)
  if redis.call('ZSCORE', other, tenant) then return end
  local old = redis.call('ZSCORE', active, tenant)
  if old then
    redis.call('ZREM', active, tenant)
    redis.call('HINCRBY', state, 'active_w', int(-tonumber(old)))
  end
end

-- Keeps H1, H5 and H7 for one tenant after its queue changed; true when it emptied.
local function repair_head(q, tenant, policy)
  local nxt = redis.call('ZRANGE', q, 0, 0)[1]
  if nxt then
    redis.call('ZADD', heads, head_score(parse(nxt), get_shift(tenant), policy), tenant)
    return false
  end
  redis.call('ZREM', heads, tenant)
  redis.call('HDEL', shift, tenant)
  deactivate(tenant, seen)
  return true
end

-- Corrections move a tenant in virtual time by delta (tag units; negative gives credit back).

-- Only the tenant's last tag moves (it reaches the tenant's next enqueue), never below vtime:
-- an idle tenant re-enters at vtime, the no-banked-credit rule of max(last, vtime).
local function move_last(tenant, delta)
  local vtime = get_vtime()
  local new = math.max(tonumber(redis.call('HGET', last, tenant) or vtime) + delta, vtime)
  redis.call('HSET', last, tenant, fmt(new))
  return new
end

-- Every queued tag of a backlogged tenant moves, and its last tag with them: right when all
-- of them queued behind the request being corrected. Credit (delta < 0) stops where the head
-- would start
--   * before the vtime it arrived at: a start tag is max(previous finish, vtime at arrival),
--     so queueing a large request and cancelling it cannot pull a later one forward;
--   * more than |delta| behind the current vtime: requests of the tenant that ran in parallel
--     moved vtime on their estimated tags, and without this bound their refunds would pile
--     up as credit below vtime (one request's overcharge is the most a tenant can hold).
local function shift_queue(q, tenant, delta, policy)
  local item, off = parse(redis.call('ZRANGE', q, 0, 0)[1]), get_shift(tenant)
  local cur = tonumber(redis.call('HGET', last, tenant) or get_vtime())
  if delta < 0 then
    local floor = math.max(item.arrival, get_vtime() + delta)
    delta = math.min(0, math.max(delta, floor - (item.start + off)))
  end
  if delta ~= 0 then
    redis.call('HSET', shift, tenant, fmt(off + delta))
    redis.call('HSET', last, tenant, fmt(cur + delta))
    if policy ~= 'fifo' then
      redis.call('ZADD', heads, head_score(item, off + delta, policy), tenant)
    end
  end
  return cur + delta
end

-- The body of enqueue.lua, shared with admission's pool-slot step (enter.lua): append a request
-- to its tenant's queue with a virtual finish tag. Returns the finish tag and the pool's arrival
-- number (1: the pool's first request since its state was created), or nil and an error reply
-- (WFQDUP: the id is already queued; WFQPOLICY) before anything but the policy is written.
-- Tag rule (Demers, Keshav, Shenker): finish = max(tenant's last tag, vtime) + cost / weight.
-- It also records when the tenant last enqueued and its weight (seen, weights, active: H6,
-- H7), which dispatch's slot fairness reads to know who is active.
-- Cost: O(log tenants + log queue length).
local function enqueue_request(q, policy, tenant, rid, cost, weight, kv, now)
  local err = claim_policy(policy)
  if err then return nil, err end
  if redis.call('HEXISTS', items, rid) == 1 then
    return nil, redis.error_reply('WFQDUP request ' .. rid .. ' is already queued')
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
  return finish, seq
end

-- enqueue.lua's and enter.lua's arguments, from ARGV[at]: policy, tenant, request_id, cost,
-- weight, kv_tokens, now ('' = server_now if given, else TIME). Returns them parsed, or nil and
-- an error reply.
local function enqueue_args(at, server_now)
  local cost, weight = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
  local kv = tonumber(ARGV[at + 5])
  if not (cost and weight and kv) or cost < 0 or weight <= 0 or kv < 0 then
    return nil, redis.error_reply('WFQARG cost, weight and kv_tokens must be numbers, weight > 0')
  end
  local now = server_now  -- one TIME per script
  if ARGV[at + 6] ~= '' or not now then now = clock(ARGV[at + 6]) end  -- before any write
  if not now then return nil, redis.error_reply('WFQARG now must be a number') end
  return {policy = ARGV[at], tenant = ARGV[at + 1], rid = ARGV[at + 2], cost = cost,
          weight = weight, kv = kv, now = now}
end
