-- relay_step.lua: one engine step's token deltas, for every request that produced tokens.
-- KEYS  stream:{rid1}, req:{rid1}, stream:{rid2}, req:{rid2}, ...
-- ARGV[1] stream MAXLEN (approximate), ARGV[2] TTL of a running stream (seconds);
--      then per request: text, token count, first ("1" on the request's first tokens),
--      the tokens delivered once this entry is written, the entry's index (1 = its first)
-- One XADD per request per step, and nothing else but on a request's first entry and first
-- tokens (the stream's TTL, the first_token_at stamp): at most one Redis command per token, however
-- few tokens a step carries (issue 30). One script per step, so a gateway blocked in XREAD is
-- woken once, after the whole step.
--
-- D1 (the delivered count is the stream's): a token entry's id is "<tokens delivered up to
--    and including it>-<how many entries of the request precede it, + 1>". The count lives in
--    the id, not in a counter beside the stream, so writing a step is one command;
--    settle.lua reads it back from the last entry (exact settlement of what was delivered,
--    ADR 0003). The index keeps ids increasing across a delta of zero tokens. Ids are far
--    below the time-based id settle.lua gives the final entry, so tokens sort before it.
-- R1 (a step is written at most once): Redis refuses an XADD whose id is not above the
--    stream's last one, so a step sent again after a lost reply (same id) writes nothing
--    twice, and neither does a step that comes after the request's final entry. A step for a
--    request whose state is gone (a Redis that restarted empty) writes nothing: a first entry
--    only when its req hash exists (and its stream gets a TTL at once), a later one only into
--    an existing stream (NOMKSTREAM), so nothing is recreated without a TTL.
local maxlen, ttl = ARGV[1], ARGV[2]
local now_ms
local written = 0

local function xadd(stream, id, text, n, create)
  local cmd = {'XADD', stream}
  if not create then cmd[#cmd + 1] = 'NOMKSTREAM' end
  local rest = {'MAXLEN', '~', maxlen, id, 't', text, 'n', n}
  for i = 1, #rest do cmd[#cmd + 1] = rest[i] end
  local ok = redis.pcall(unpack(cmd))
  if type(ok) == 'table' and ok.err then
    -- R1: an id at or below the last one is a step already written; anything else is a bug.
    if string.find(ok.err, 'equal or smaller', 1, true) then return false end
    return redis.error_reply(ok.err)
  end
  return ok ~= false and ok ~= nil
end

for k = 0, #KEYS / 2 - 1 do
  local stream, req, a = KEYS[2 * k + 1], KEYS[2 * k + 2], 3 + 5 * k
  local create, first = ARGV[a + 4] == '1', ARGV[a + 2] == '1'
  if not create or redis.call('EXISTS', req) == 1 then
    local id = ARGV[a + 3] .. '-' .. ARGV[a + 4]
    local done = xadd(stream, id, ARGV[a], ARGV[a + 1], create)
    if type(done) == 'table' then return done end  -- an error reply
    if done then
      if create then redis.call('EXPIRE', stream, ttl) end
      if first then
        if not now_ms then  -- the Redis clock, like admitted_at
          local t = redis.call('TIME')
          now_ms = tostring(math.floor((tonumber(t[1]) + tonumber(t[2]) / 1e6) * 1000))
        end
        redis.call('HSETNX', req, 'first_token_at', now_ms)
      end
      written = written + 1
    end
  end
end
return written
