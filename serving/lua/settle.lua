-- settle.lua: end a request exactly once: record usage, post the last event, correct its
-- tenant's WFQ tags, and say what release.lua must give back on the tenant's slot.
-- Every key is on the request's pool's slot (ADR 0018), so this is all of settlement that one
-- script can do: the tenant's refund is release.lua, on the other slot (ADR 0028).
--
-- KEYS[1..8] the pool's eight WFQ keys (wfq/common.lua)  KEYS[9] req:{p.POOL}:rid
-- KEYS[10] deadlines:{p.POOL}  KEYS[11] usage:{p.POOL}:pending  KEYS[12] stream:{p.POOL}:rid
-- ARGV[1] rid  ARGV[2] now in seconds ('' = Redis TIME)  ARGV[3] status  ARGV[4] finish reason
-- ARGV[5] prompt tokens (-1 = the amount charged at admission)  ARGV[6] cached prompt tokens
-- ARGV[7] output tokens (-1 = the count delivered to the stream so far)  ARGV[8] error code
-- ARGV[9] stream MAXLEN  ARGV[10] stream TTL after the end  ARGV[11] req:{rid} TTL after the end
-- ARGV[12] an in-flight set to leave ('' = the one recorded at claim)
-- ARGV[13] '1' = correct the tenant's WFQ tags  ARGV[14..16] WFQ prices: input, output, KV
-- ARGV[17] the pool's WFQ queue key prefix (+ tenant = its queue)
-- ARGV[18..] field, value pairs of a final stream event ('' first field = none)
--
-- Invariants:
--   S1  once: the first call flips state to 'settled'; every later call returns {0, state} and
--       writes nothing, so the usage record happens exactly once, and only the winner is told
--       to release (release.lua's token makes that once too, even if the winner retries).
--   S2  the usage record is pushed by the same script that settles, so a settled request has
--       exactly one record and a record always belongs to a settled request.
--   S3  the refund and the counters are the tenant's, on another slot: the reply carries the
--       bucket deltas and keys for release.lua (invariants R1, R2 there; A5 in admit.lua
--       covers a winner that dies before releasing).
--   S4  the request leaves the deadlines zset and its worker's in-flight set in this step.
--   S5  a dispatched request's WFQ correction ((actual - estimated cost) / weight, as
--       wfq/complete.lua moves a tenant) happens in this step, so exactly once with S1; one
--       removed from its queue before dispatch gets none (remove.lua gave its whole cost back).
--! include wfq/common

local st = redis.call('HGET', KEYS[9], 'state')
if not st then return {0, 'unknown'} end
if st == 'settled' then return {0, st} end

local now = clock(ARGV[2])
local now_ms = math.floor(now * 1000)
local h = {}
local flat = redis.call('HGETALL', KEYS[9])
for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end

local charged_in, charged_out = tonumber(h.p), tonumber(h.o)
local prompt = tonumber(ARGV[5])
if prompt < 0 then prompt = charged_in end
local output = tonumber(ARGV[7])
if output < 0 then  -- relay_step.lua D1: the last token entry's id holds the count
  local last = redis.call('XREVRANGE', KEYS[12], '+', '-', 'COUNT', 1)[1]
  output = last and tonumber(string.match(last[1], '^(%d+)-')) or 0
end
local cached = math.min(tonumber(ARGV[6]), prompt)

redis.call('ZREM', KEYS[10], ARGV[1])
if h.inflight then redis.call('SREM', h.inflight, ARGV[1]) end
if ARGV[12] ~= '' then redis.call('SREM', ARGV[12], ARGV[1]) end

local admitted = tonumber(h.admitted_at)
local dispatched = tonumber(h.dispatched_at or '')
local first = tonumber(h.first_token_at or '')
local record = {
  request_id = ARGV[1],
  tenant_id = tonumber(h.tenant) or h.tenant,
  key_id = tonumber(h.key or '') or cjson.null,
  model = h.model or cjson.null,
  pool = h.pool or cjson.null,
  end_user = (h.end_user or '') ~= '' and h.end_user or cjson.null,
  prompt_tokens = prompt,
  cached_tokens = cached,
  completion_tokens = output,
  queue_wait_ms = (dispatched or now_ms) - admitted,
  ttft_ms = first and (first - admitted) or cjson.null,
  total_ms = now_ms - admitted,
  status = ARGV[3],
  finish_reason = ARGV[4] ~= '' and ARGV[4] or cjson.null,
  error_code = ARGV[8] ~= '' and ARGV[8] or cjson.null,
  stream = h.stream == '1',
  admitted_at_ms = admitted,
  dispatched_at_ms = dispatched or cjson.null,
  first_token_at_ms = first or cjson.null,
  settled_at_ms = now_ms,
  -- For the tenants' request log (metering.requestlog); set by submit's context when known.
  project_id = tonumber(h.project or '') or cjson.null,
}
local encoded = cjson.encode(record)
redis.call('RPUSH', KEYS[11], encoded)

-- The transit payload (prompt ids, sampling) never outlives the request.
redis.call('HDEL', KEYS[9], 'prompt_ids', 'sampling', 'salt', 'priority')
redis.call('HSET', KEYS[9], 'state', 'settled', 'status', ARGV[3], 'settled_at', tostring(now_ms),
           'out_final', tostring(output), 'in_final', tostring(prompt))
redis.call('EXPIRE', KEYS[9], tonumber(ARGV[11]))

if ARGV[18] and ARGV[18] ~= '' then
  local ev = {}
  for i = 18, #ARGV do ev[#ev + 1] = ARGV[i] end
  redis.call('XADD', KEYS[12], 'MAXLEN', '~', ARGV[9], '*', unpack(ev))
end
if redis.call('EXISTS', KEYS[12]) == 1 then redis.call('EXPIRE', KEYS[12], tonumber(ARGV[10])) end
-- S5: the WFQ correction, at the dispatcher's prices (serving.wfq.Prices.cost).
local was_dispatched = (h.dispatched_at or ARGV[12] ~= '') and true or false
if was_dispatched and ARGV[13] == '1' and h.tenant then
  local p_in, p_out, p_kv = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16])
  local function cost(p, o) return p_in * p + p_out * o + p_kv * o * (p + o / 2) end
  local delta = (cost(prompt, output) - cost(charged_in, charged_out)) / tonumber(h.weight or '1')
  local q = ARGV[17] .. h.tenant
  if redis.call('EXISTS', q) == 1 then
    shift_queue(q, h.tenant, delta, pool_policy())
  else
    move_last(h.tenant, delta)
  end
end
-- What release.lua needs: the engine's counts win, so refund what was charged but not used and
-- charge what was used beyond (tenant input, tenant output, key input, key output).
local out = {1, encoded, h.pool or '', h.tenant or '', h.weight or '1', tostring(charged_in),
             tostring(charged_out), tostring(prompt), tostring(output),
             was_dispatched and '1' or '0', h.tk or '', h.tw or ''}
local deltas = {charged_in - prompt, charged_out - output, charged_in - prompt, charged_out - output}
for i = 1, 4 do
  out[#out + 1] = h['b' .. i] or ''
  out[#out + 1] = tostring(deltas[i])
  out[#out + 1] = h['r' .. i] or '0'
  out[#out + 1] = h['x' .. i] or '0'
end
-- Budgets (serving.budgets): their counters, metrics, reserved amounts and the prices fixed at
-- admission, and the cached count, so the winner computes the exact cost for release.lua.
for _, f in ipairs({'bk', 'bm', 'bv', 'pi', 'pc', 'po'}) do out[#out + 1] = h[f] or '' end
out[#out + 1] = tostring(cached)
return out
