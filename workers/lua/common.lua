-- Shared prelude, prepended to every WFQ script at load time (workers/wfq.py).
--
-- Keys of one pool P (all under settings.REDIS_KEY_PREFIX); every script gets the first five
-- as KEYS[1..5], in this order:
--   wfq:P:heads  zset  tenant -> head score    one member per backlogged tenant
--   wfq:P:items  hash  request id -> entry      every queued request, nothing else
--   wfq:P:state  hash  vtime, seq, policy       virtual time, arrival counter, policy
--   wfq:P:last   hash  tenant -> finish tag     tag of the tenant's latest enqueue, corrected
--   wfq:P:shift  hash  tenant -> offset         added to the tags stored in T's entries
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
--   H5 shift has an entry only for backlogged tenants.
--
-- Numbers are Lua doubles. They go back to Redis as strings formatted with %.17g, because
-- Redis converts a bare Lua number with %.14g (losing digits) and truncates number replies.

local heads, items, state, last, shift = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

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

-- Keeps H1 and H5 for one tenant after its queue changed.
local function repair_head(q, tenant, policy)
  local nxt = redis.call('ZRANGE', q, 0, 0)[1]
  if nxt then
    redis.call('ZADD', heads, head_score(parse(nxt), get_shift(tenant), policy), tenant)
  else
    redis.call('ZREM', heads, tenant)
    redis.call('HDEL', shift, tenant)
  end
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
