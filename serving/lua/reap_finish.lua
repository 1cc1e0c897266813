-- reap_finish.lua: forget a dead worker once none of its requests is left unsettled.
-- KEYS[1] workers:{p.POOL}  KEYS[2] worker:{p.POOL}:wid:inflight  KEYS[3] worker:{p.POOL}:wid:load
-- ARGV[1] worker id
if redis.call('SCARD', KEYS[2]) > 0 then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
