-- queued: every queued request with its effective tags, as one consistent snapshot.
-- KEYS: the eight common keys. Returns a list of packed entries.
local out, offs = {}, {}
for _, entry in ipairs(redis.call('HVALS', items)) do
  local item = parse(entry)
  offs[item.tenant] = offs[item.tenant] or get_shift(item.tenant)
  local off = offs[item.tenant]
  out[#out + 1] = pack(item.finish + off, item.start + off, item)
end
return out
