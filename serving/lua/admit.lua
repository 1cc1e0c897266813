-- admit.lua: charge every limit of one request in one step, or charge nothing.
--
-- KEYS[1]  req:{rid}            KEYS[2]  deadlines (zset)
-- KEYS[3..6]  token buckets: tenant input, tenant output, key input, key output (hash level, ts)
-- KEYS[7..8]  concurrency counters: tenant, key
-- KEYS[9..10] open-stream counters: tenant, key
-- ARGV[1] rid  ARGV[2] now in seconds ('' = Redis TIME)  ARGV[3] prompt tokens
-- ARGV[4] max output tokens  ARGV[5] stream (0/1)  ARGV[6] seconds until the backstop settles it
-- ARGV[7..14] rate per minute, burst for the four buckets (rate 0 = not limited)
-- ARGV[15..16] concurrency limits, ARGV[17..18] open-stream limits (0 = not limited)
-- ARGV[19..] field, value pairs stored in req:{rid} on success
--
-- Invariants (tests/test_accounting.py tries to break them):
--   A1  every bucket level stays within [0, burst]: refill is capped at burst and a charge is
--       made only when level >= amount.
--   A2  all or nothing: every check runs before the first write, so a rejection writes nothing.
--   A3  a counter never exceeds its limit: check and increment happen in this one script.
--   A4  a request id is admitted once: an existing req:{rid} is refused ("duplicate").

local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, 'duplicate', '', '0', '-1', '-1', '-1', '-1', '0'}
end
local prompt = tonumber(ARGV[3])
local max_out = tonumber(ARGV[4])
local stream = tonumber(ARGV[5])
local amounts = {prompt, max_out, prompt, max_out}
local scopes = {'tenant', 'tenant', 'key', 'key'}
local kinds = {'input_tokens', 'output_tokens', 'input_tokens', 'output_tokens'}

-- Current level of each limited bucket, refilled continuously up to its burst (A1).
local levels, rates, bursts = {}, {}, {}
for i = 1, 4 do
  rates[i] = tonumber(ARGV[5 + 2 * i])
  bursts[i] = tonumber(ARGV[6 + 2 * i])
  if rates[i] > 0 then
    local v = redis.call('HMGET', KEYS[2 + i], 'level', 'ts')
    local level, ts = tonumber(v[1]), tonumber(v[2])
    if not level then
      level = bursts[i]
    else
      local elapsed = math.max(0, now - ts)  -- a clock that steps back refills nothing
      level = math.min(bursts[i], level + elapsed * rates[i] / 60)
    end
    levels[i] = level
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
  if not pick then return {tostring(req_limit), tostring(math.max(req_rem, 0)), '-1', '-1', '0'} end
  local left = levels[pick] - charged * amounts[pick]
  local reset = (bursts[pick] - left) * 60 / rates[pick]
  return {tostring(req_limit), tostring(math.max(req_rem, 0)), tostring(rates[pick]),
          tostring(math.floor(math.max(left, 0))), string.format('%.3f', reset)}
end

local function reject(reason, scope, retry_after, failing)
  local h = header_values(0, failing)
  return {0, reason, scope, tostring(retry_after), h[1], h[2], h[3], h[4], h[5]}
end

-- 1. A request bigger than a bucket can ever hold never fits: a distinct answer, no retry time.
for i = 1, 4 do
  if rates[i] > 0 and amounts[i] > bursts[i] then
    return reject('too_large', scopes[i] .. ':' .. kinds[i], 0, i)
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
  if rates[i] > 0 then
    redis.call('HSET', KEYS[2 + i], 'level', string.format('%.6f', levels[i] - amounts[i]),
               'ts', string.format('%.6f', now))
  end
end
for j = 1, 2 do
  redis.call('INCR', KEYS[6 + j])
  if stream == 1 then redis.call('INCR', KEYS[8 + j]) end
end

local now_ms = math.floor(now * 1000)
local fields = {
  'state', 'queued', 'admitted_at', tostring(now_ms), 'p', ARGV[3], 'o', ARGV[4],
  'stream', ARGV[5], 'delivered', '0',
  'b1', KEYS[3], 'b2', KEYS[4], 'b3', KEYS[5], 'b4', KEYS[6],
  'c1', KEYS[7], 'c2', KEYS[8], 's1', KEYS[9], 's2', KEYS[10],
}
for i = 1, 4 do
  fields[#fields + 1] = 'r' .. i
  fields[#fields + 1] = ARGV[5 + 2 * i]
  fields[#fields + 1] = 'x' .. i
  fields[#fields + 1] = ARGV[6 + 2 * i]
end
for i = 19, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], string.format('%.3f', now + tonumber(ARGV[6])), ARGV[1])
return {1, 'ok', '', '0', headers[1], headers[2], headers[3], headers[4], headers[5]}
