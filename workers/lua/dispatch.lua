-- dispatch: pop up to n requests in tag order into one worker's free capacity.
-- KEYS: heads, items, state, last, shift, inflight(worker)
-- ARGV: queue key prefix (+ tenant = queue key), n, kv budget, lookahead
-- Returns {vtime, entry...} with effective tags; no entries when the pool is empty or the
-- next request does not fit.
--
-- Head-of-line by tag: when the smallest-tag head does not fit the budget, stop rather than
-- skip to a smaller request, or large requests would starve behind a stream of small ones.
-- lookahead > 0 opts into considering that many further tenant heads (bounded skipping).
-- vtime = max(vtime, start tag of the request entering service) (start-time fair queueing,
-- Goyal et al.), so a tenant that was idle re-enters at the current virtual time.
-- The id leaves items and its queue and enters the worker's in-flight set in this one
-- script (H3): never in both, never dispatched twice, never dropped.
-- Cost per request: O(log tenants + log queue length).
local inflight = KEYS[6]
local qprefix, policy = ARGV[1], pool_policy()
local n, budget, lookahead = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])

local vtime0 = get_vtime()
local vtime = vtime0
local out = {''}

local function pick()
  for _, tenant in ipairs(redis.call('ZRANGE', heads, 0, lookahead)) do
    local entry = redis.call('ZRANGE', qprefix .. tenant, 0, 0)[1]
    local item = parse(entry)
    if item.kv <= budget then return tenant, entry, item end
  end
  return nil
end

while #out <= n do
  local tenant, entry, item = pick()
  if not tenant then break end
  local q, off = qprefix .. tenant, get_shift(tenant)
  redis.call('ZREM', q, entry)
  redis.call('HDEL', items, item.rid)
  repair_head(q, tenant, policy)
  redis.call('SADD', inflight, item.rid)
  budget = budget - item.kv
  local start = item.start + off
  if start > vtime then vtime = start end
  out[#out + 1] = pack(item.finish + off, start, item)
end

if vtime > vtime0 then redis.call('HSET', state, 'vtime', fmt(vtime)) end  -- H4
out[1] = fmt(vtime)
return out
