-- reap_mark.lua: declare a worker dead if its last heartbeat is still too old.
--
-- KEYS[1] workers:{p.POOL}  KEYS[2] worker:{p.POOL}:wid:reaped
-- ARGV[1] worker id  ARGV[2] dead-after seconds  ARGV[3] marker TTL seconds
-- Returns 1 when the worker is (now, or already) marked dead, 0 when it beat in time.
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '')
if not score then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
if now - score < tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[3]))
return 1
