-- prelude clock: the time a script runs at, in seconds.
-- The caller's clock when it passes one (simulations on a virtual clock), else the Redis
-- server's, so every gateway and worker reads the same clock. TIME in a script that writes needs
-- effects replication, the default since Redis 5.
local function clock(arg)
  if arg and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
