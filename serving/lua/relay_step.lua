-- relay_step.lua: one engine step's token deltas, for every request that produced tokens.
-- KEYS  stream:{rid1}, req:{rid1}, stream:{rid2}, req:{rid2}, ...
-- ARGV[1] stream MAXLEN (approximate), ARGV[2] TTL of a running stream (seconds);
--      then per request: text, token count, first ("1" on the request's first tokens),
--      before (the tokens the worker relayed for it in earlier steps)
-- The same commands a pipeline would send (XADD + HINCRBY delivered per request, and on the
-- first tokens the first_token_at stamp and the stream's TTL), in one call: one command to
-- parse per step instead of two to four per request, and a gateway blocked in XREAD is woken
-- once, after the whole step, instead of after the first XADD of it.
--
-- R1 (a step is written at most once): a request's delta is written only while its delivered
-- count equals `before`. A step sent again after a lost reply finds delivered already moved
-- and writes nothing twice; so does a step for a request whose state is gone (a Redis that
-- restarted empty), which would otherwise recreate its keys without a TTL.
local maxlen, ttl = ARGV[1], ARGV[2]
local now_ms
local written = 0
for k = 0, #KEYS / 2 - 1 do
  local stream, req, a = KEYS[2 * k + 1], KEYS[2 * k + 2], 3 + 4 * k
  local delivered = tonumber(redis.call('HGET', req, 'delivered') or '0')
  if delivered == tonumber(ARGV[a + 3]) then
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 't', ARGV[a], 'n', ARGV[a + 1])
    redis.call('HINCRBY', req, 'delivered', ARGV[a + 1])
    if ARGV[a + 2] == '1' then
      if not now_ms then  -- the Redis clock, like admitted_at
        local t = redis.call('TIME')
        now_ms = tostring(math.floor((tonumber(t[1]) + tonumber(t[2]) / 1e6) * 1000))
      end
      redis.call('HSETNX', req, 'first_token_at', now_ms)
      redis.call('EXPIRE', stream, ttl)
    end
    written = written + 1
  end
end
return written
