-- leave.lua: a worker that drained leaves its pool (nothing of it is left to reap).
-- KEYS[1] workers:{p.POOL}  KEYS[2] worker:{p.POOL}:wid:inflight  KEYS[3] worker:{p.POOL}:wid:load
-- ARGV[1] worker id
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[3])
return redis.call('SCARD', KEYS[2])
