-- admit.lua: charge every limit of one request in one step, or charge nothing.
-- Every key is on the tenant's slot (hash tag {t.TENANT}, key buckets and counters included).
-- The request's own state is written next, on its pool's slot, by enter.lua (ADR 0018, 0028).
--
-- KEYS[1]  charges (zset rid -> release-by time: one release token per charged request)
-- KEYS[2]  charges:what (hash rid -> the counter keys to release, space-separated)
-- KEYS[3..6]  token buckets: tenant input, tenant output, key input, key output (hash level, ts)
-- KEYS[7..8]  concurrency counters: tenant, key
-- KEYS[9..10] open-stream counters: tenant, key
-- ARGV[1] rid  ARGV[2] now in seconds ('' = Redis TIME)  ARGV[3] prompt tokens
-- ARGV[4] max output tokens  ARGV[5] stream (0/1)  ARGV[6] seconds until the token expires
-- ARGV[7..14] rate per minute, burst for the four buckets (rate 0 = not limited)
-- ARGV[15..16] concurrency limits, ARGV[17..18] open-stream limits (0 = not limited)
-- KEYS[11..10+N] budget counters (serving.budgets: one per budget in the request's chain, the
--   period's label in the key)  ARGV[19] N, then per budget: limit, amount reserved, counter TTL
--   in seconds (0 = none, a lifetime budget); integers (micro-units of money, or tokens)
--
-- Invariants (tests/test_accounting.py tries to break them):
--   A1  every bucket level stays within [0, burst]: refill is capped at burst and a charge is
--       made only when level >= amount.
--   A2  all or nothing: every check runs before the first charge, so a rejection charges
--       nothing (the prune of A5 may still release expired tokens).
--   A3  a counter never exceeds its limit: check and increment happen in this one script.
--   A4  a request id is charged once while its token lives: an existing token is refused
--       ("duplicate"); enter.lua refuses an id whose req hash exists.
--   A5  the counters a request took are given back exactly once: by release.lua, which runs
--       only if it removes the token, or, when no release came by the token's expiry (a
--       process died between admit and enter, or between settle and release), by the prune
--       below, which also removes the token first. Buckets are not refunded by the prune:
--       they refill by themselves, so a lost refund costs the tenant at most one charge's
--       worth of rate for a minute.
--   B1  a budget counter never exceeds its limit through admission: each reservation is
--       checked (used + amount <= limit) and added in this one script, so any number of
--       gateways racing for the last unit of a budget admit at most what it holds.
--   B2  a refused request reserves nothing (A2): every budget is checked before any charge.
--       Settlement gives back the unused part once (release.lua, R1); admit.lua's prune (A5)
--       never touches budgets, so a lost release over-counts spend, never under-counts it.
--   H1  the headers state the reservation rule: x-ratelimit-remaining-tokens is the reported
--       bucket's level after this request's reservation (admitted) or now (refused), and
--       x-ratelimit-reserved-tokens what this request takes from it; a request is refused by
--       that bucket exactly when reserved > remaining (serving.admission.RateLimitInfo).
--   C1  a split tenant's bucket holds its cell's share (share_rate, share_burst, written by
--       cell_share.lua): it replaces the caller's rate and burst, so every gateway of the cell
--       enforces the share the rebalancer last set, atomically with the charge (docs/adr/0019).

--! include clock
--! include bucket

local PRUNE = 16
local now = clock(ARGV[2])
-- A5: release the counters of requests whose release never came (at most PRUNE per call).
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, PRUNE)
for _, rid in ipairs(expired) do
  local what = redis.call('HGET', KEYS[2], rid) or ''
  for k in string.gmatch(what, '%S+') do
    if redis.call('DECR', k) < 0 then redis.call('SET', k, '0') end
  end
  redis.call('ZREM', KEYS[1], rid)
  redis.call('HDEL', KEYS[2], rid)
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return {0, 'duplicate', '', '0', '-1', '-1', '-1', '-1', '0'}
end
local prompt = tonumber(ARGV[3])
local max_out = tonumber(ARGV[4])
local stream = tonumber(ARGV[5])
local amounts = {prompt, max_out, prompt, max_out}
local scopes = {'tenant', 'tenant', 'key', 'key'}
local kinds = {'input_tokens', 'output_tokens', 'input_tokens', 'output_tokens'}

-- Current level of each limited bucket, refilled continuously up to its burst (A1), at its
-- cell's share if it has one (C1): bucket_read in prelude/bucket.lua.
local levels, rates, bursts = {}, {}, {}
for i = 1, 4 do
  rates[i] = tonumber(ARGV[5 + 2 * i])
  bursts[i] = tonumber(ARGV[6 + 2 * i])
  if rates[i] > 0 then
    levels[i], rates[i], bursts[i] = bucket_read(KEYS[2 + i], rates[i], bursts[i], now)
  end
end

local function counter(k) return tonumber(redis.call('GET', k) or '0') end
local conc = {counter(KEYS[7]), counter(KEYS[8])}
local conc_limits = {tonumber(ARGV[15]), tonumber(ARGV[16])}
local streams = {counter(KEYS[9]), counter(KEYS[10])}
local stream_limits = {tonumber(ARGV[17]), tonumber(ARGV[18])}

-- Header values: the tightest concurrency scope and the emptiest token bucket.
local function header_values(charged, failing)
  local req_limit, req_rem = -1, -1
  for j = 1, 2 do
    if conc_limits[j] > 0 then
      local rem = conc_limits[j] - conc[j] - charged
      if req_limit < 0 or rem < req_rem then req_limit, req_rem = conc_limits[j], rem end
    end
  end
  local pick = failing
  if not pick then
    for i = 1, 4 do
      if rates[i] > 0 then
        local after = levels[i] - charged * amounts[i]
        if not pick or after < levels[pick] - charged * amounts[pick] then pick = i end
      end
    end
  end
  if not pick then
    return {tostring(req_limit), tostring(math.max(req_rem, 0)), '-1', '-1', '0', '-1'}
  end
  local left = levels[pick] - charged * amounts[pick]
  local reset = (bursts[pick] - left) * 60 / rates[pick]
  -- The 6th value is what this request reserves from the reported bucket (the reservation
  -- rule: prompt, or n x max_tokens): refused whenever it exceeds the remaining (H1).
  return {tostring(req_limit), tostring(math.max(req_rem, 0)), tostring(rates[pick]),
          tostring(math.floor(math.max(left, 0))), string.format('%.3f', reset),
          tostring(amounts[pick])}
end

local function reject(reason, scope, retry_after, failing)
  local h = header_values(0, failing)
  return {0, reason, scope, tostring(retry_after), h[1], h[2], h[3], h[4], h[5], h[6]}
end

-- 1. A request bigger than a bucket can ever hold never fits: a distinct answer, no retry time.
for i = 1, 4 do
  if rates[i] > 0 and amounts[i] > bursts[i] then
    return reject('too_large', scopes[i] .. ':' .. kinds[i], 0, i)
  end
end
-- 1b. Budgets (B1, B2): the reservation must fit under every budget's limit.
local n_budgets = tonumber(ARGV[19] or '0') or 0
for b = 1, n_budgets do
  local limit, amount = tonumber(ARGV[17 + 3 * b]), tonumber(ARGV[18 + 3 * b])
  local used = tonumber(redis.call('GET', KEYS[10 + b]) or '0')
  if used + amount > limit then
    local h = header_values(0, nil)
    return {0, 'insufficient_quota', tostring(b), '0', h[1], h[2], h[3], h[4], h[5], h[6],
            tostring(used)}
  end
end
-- 2. Concurrency and open streams: a slot frees when some request ends; no rate to compute.
for j = 1, 2 do
  if conc_limits[j] > 0 and conc[j] + 1 > conc_limits[j] then
    return reject('concurrency', scopes[2 * j], 1, nil)
  end
  if stream == 1 and stream_limits[j] > 0 and streams[j] + 1 > stream_limits[j] then
    return reject('open_streams', scopes[2 * j], 1, nil)
  end
end
-- 3. Tokens: report the bucket that needs longest, so retrying after Retry-After can succeed.
local worst, worst_wait = nil, 0
for i = 1, 4 do
  if rates[i] > 0 and levels[i] < amounts[i] then
    local wait = math.ceil((amounts[i] - levels[i]) * 60 / rates[i])
    if wait < 1 then wait = 1 end
    if not worst or wait > worst_wait then worst, worst_wait = i, wait end
  end
end
if worst then return reject(kinds[worst], scopes[worst], worst_wait, worst) end

-- Every check passed: charge everything (A2).
local headers = header_values(1, nil)
for i = 1, 4 do
  if rates[i] > 0 then bucket_write(KEYS[2 + i], levels[i] - amounts[i], now) end
end
for b = 1, n_budgets do
  redis.call('INCRBY', KEYS[10 + b], tonumber(ARGV[18 + 3 * b]))
  local ttl = tonumber(ARGV[19 + 3 * b])
  if ttl > 0 then redis.call('EXPIRE', KEYS[10 + b], ttl) end
end
local taken = {}
for j = 1, 2 do
  redis.call('INCR', KEYS[6 + j])
  taken[#taken + 1] = KEYS[6 + j]
  if stream == 1 then
    redis.call('INCR', KEYS[8 + j])
    taken[#taken + 1] = KEYS[8 + j]
  end
end
redis.call('ZADD', KEYS[1], string.format('%.3f', now + tonumber(ARGV[6])), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], table.concat(taken, ' '))
return {1, 'ok', '', '0', headers[1], headers[2], headers[3], headers[4], headers[5],
        headers[6]}
