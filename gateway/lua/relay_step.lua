-- relay_step.lua: one engine step's token deltas, for every request that produced tokens.
-- KEYS  stream:{rid1}, req:{rid1}, stream:{rid2}, req:{rid2}, ...
-- ARGV[1] stream MAXLEN (approximate); then per request: text, token count
-- The same commands a pipeline would send (XADD + HINCRBY delivered per request), in one call:
-- one command to parse per step instead of two per request, and a gateway blocked in XREAD is
-- woken once, after the whole step, instead of after the first XADD of it.
local maxlen = ARGV[1]
for i = 1, #KEYS, 2 do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 't', ARGV[i + 1], 'n', ARGV[i + 2])
  redis.call('HINCRBY', KEYS[i + 1], 'delivered', ARGV[i + 2])
end
return #KEYS / 2
