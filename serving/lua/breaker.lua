-- A pool's circuit breaker (serving/health.py). One hash per pool, on the pool's slot.
-- KEYS[1] breaker:{p.P}  (hash: state, fails, opened_at, probe_until, reason)
-- KEYS[2] workers:{p.P}  (zset worker -> last heartbeat, seconds)
-- ARGV: op (allow | success | failure), now (s), live_cutoff (s), threshold, cooldown (s),
--       probe (s)
-- Returns {allowed 0/1, state, reason}.
--
-- Invariants (every change to a breaker is this script, so they hold across all gateways):
-- B1 state is closed, open or half_open; `fails` counts consecutive failures since the last
--    success and resets to 0 on every success.
-- B2 an allow on a pool with no live worker never answers 1 and leaves it open (reason
--    no_worker): nothing is queued where nobody will take it.
-- B3 open answers 0 until `cooldown` has passed since opened_at; then exactly one caller per
--    `probe` window gets 1 (half_open, probe_until set in the same call), every other caller 0.
-- B4 a failure while half_open, or the threshold-th consecutive failure, opens it; a success
--    closes it. A pool whose breaker opened for no_worker closes at the first allow that sees
--    a live worker (the cause is gone; a probe would only delay it).
local op, now = ARGV[1], tonumber(ARGV[2])
local cutoff, threshold = tonumber(ARGV[3]), tonumber(ARGV[4])
local cooldown, probe = tonumber(ARGV[5]), tonumber(ARGV[6])
local h = redis.call('HMGET', KEYS[1], 'state', 'fails', 'opened_at', 'probe_until', 'reason')
local state, fails = h[1] or 'closed', tonumber(h[2] or '0')
local opened_at, probe_until, reason = tonumber(h[3] or '0'), tonumber(h[4] or '0'), h[5] or ''

local function open(why)
  redis.call('HSET', KEYS[1], 'state', 'open', 'opened_at', tostring(now), 'reason', why,
             'fails', tostring(fails), 'probe_until', '0')
  return {0, 'open', why}
end

if op == 'success' then
  redis.call('HSET', KEYS[1], 'state', 'closed', 'fails', '0', 'reason', '', 'probe_until', '0')
  return {1, 'closed', ''}
end
if op == 'failure' then
  fails = fails + 1
  if state == 'half_open' or fails >= threshold then
    return open('failures')
  end
  redis.call('HSET', KEYS[1], 'fails', tostring(fails))
  return {1, state, reason}
end
-- allow
if redis.call('ZCOUNT', KEYS[2], cutoff, '+inf') == 0 then
  if state ~= 'open' or reason ~= 'no_worker' then
    return open('no_worker')
  end
  return {0, 'open', 'no_worker'}
end
if state == 'closed' then
  return {1, 'closed', ''}
end
if state == 'open' and reason == 'no_worker' then
  redis.call('HSET', KEYS[1], 'state', 'closed', 'fails', '0', 'reason', '', 'probe_until', '0')
  return {1, 'closed', ''}
end
if state == 'open' and now < opened_at + cooldown then
  return {0, 'open', reason}
end
if state == 'half_open' and now < probe_until then
  return {0, 'half_open', reason}
end
redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe_until', tostring(now + probe))
return {1, 'half_open', reason}
