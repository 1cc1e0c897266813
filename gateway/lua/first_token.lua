-- first_token.lua: stamp the time of the first output token (Redis clock, like admitted_at).
-- KEYS[1] req:{rid}
local t = redis.call('TIME')
local ms = math.floor((tonumber(t[1]) + tonumber(t[2]) / 1e6) * 1000)
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSETNX', KEYS[1], 'first_token_at', tostring(ms))
end
return ms
