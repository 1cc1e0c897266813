-- cell_share.lua: read or move one split tenant's share of its quota in one cell's Redis.
--
-- KEYS[1] the tenant's input bucket  KEYS[2] its output bucket (admit.lua KEYS[3], KEYS[4])
-- ARGV[1] now in seconds ('' = Redis TIME)  ARGV[2] 'read', 'peek' (read, keep the demand) or 'set'
-- ARGV[3..6] the floor share: input rate, input burst, output rate, output burst. A bucket
--            without share fields holds exactly this (the gateways pass it as their rate).
-- 'set' only:
-- ARGV[7..10]  the target share (same order)
-- ARGV[11..14] how far each figure may grow above the share in force (0 = shrink only)
--
-- Returns (as strings) the share in force before the step (4 figures), after it (4 figures)
-- and the demand counted since the last read (tokens requested; 'read' resets it to 0).
--
-- Invariants (serving/cells.py states the bound they give; tests/test_cells.py tries them):
--   C2  a figure becomes min(target, current + allowance): it never grows by more than the
--       caller's allowance, which the rebalancer takes from the quota's unassigned headroom,
--       so the sum of the cells' shares never exceeds the quota.
--   C3  before the share changes, the bucket is refilled up to now at the old rate and capped
--       at the old burst; after it, the level is capped at the new burst. Tokens a cell could
--       admit are therefore at most its level plus its current rate times the time elapsed,
--       whatever the history of its share.
--   C4  the share only ever lies in [floor, quota]: targets are at least the floor, so a cell
--       that loses its Redis state (back to the floor) can only hold less than was assigned.

--! include clock
--! include bucket

local now = clock(ARGV[1])
local fmt = function(x) return string.format('%.6f', x) end
local before, after = {}, {}
for b = 1, 2 do
  -- the share in force (or the floor), and the level refilled up to now at it (as admit.lua)
  local level, rate, burst = bucket_read(KEYS[b], tonumber(ARGV[1 + 2 * b]),
                                         tonumber(ARGV[2 + 2 * b]), now)
  before[2 * b - 1], before[2 * b] = rate, burst
  after[2 * b - 1], after[2 * b] = rate, burst
  if ARGV[2] == 'set' then
    local new_rate = math.min(tonumber(ARGV[5 + 2 * b]), rate + tonumber(ARGV[9 + 2 * b]))
    local new_burst = math.min(tonumber(ARGV[6 + 2 * b]), burst + tonumber(ARGV[10 + 2 * b]))
    level = math.max(0, math.min(level, new_burst))  -- C3
    redis.call('HSET', KEYS[b], 'level', fmt(level), 'ts', fmt(now),
               'share_rate', fmt(new_rate), 'share_burst', fmt(new_burst))
    after[2 * b - 1], after[2 * b] = new_rate, new_burst
  end
end
local demand = redis.call('HGET', KEYS[2], 'demand') or '0'
if ARGV[2] == 'read' then redis.call('HSET', KEYS[2], 'demand', '0') end
local out = {}
for i = 1, 4 do out[i] = fmt(before[i]) end
for i = 1, 4 do out[4 + i] = fmt(after[i]) end
out[9] = demand
return out
