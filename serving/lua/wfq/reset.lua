-- reset: delete every key of one pool (tests, benchmarks, decommissioning a pool).
-- KEYS: the eight common keys; ARGV: queue key prefix.
-- Queues are found through heads and items, so a pool that broke H1 is still emptied.
for _, tenant in ipairs(redis.call('ZRANGE', heads, 0, -1)) do
  redis.call('DEL', ARGV[1] .. tenant)
end
for _, entry in ipairs(redis.call('HVALS', items)) do
  redis.call('DEL', ARGV[1] .. parse(entry).tenant)
end
return redis.call('DEL', heads, items, state, last, shift, seen, weights, active)
