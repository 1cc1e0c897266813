-- backlog: queued requests per backlogged tenant, as one consistent snapshot.
-- KEYS: the eight common keys; ARGV: queue key prefix.
-- Returns {tenant, count, tenant, count, ...}.
local out = {}
for _, tenant in ipairs(redis.call('ZRANGE', heads, 0, -1)) do
  out[#out + 1] = tenant
  out[#out + 1] = redis.call('ZCARD', ARGV[1] .. tenant)
end
return out
