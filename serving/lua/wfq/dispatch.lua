-- dispatch: pop up to n requests in tag order into one worker's free capacity.
-- KEYS: the eight common keys, inflight(worker)
-- ARGV: queue key prefix (+ tenant = queue key), n, kv budget, lookahead,
--       fair ('1' = slot fairness, below; '0' = none), free slots, now ('' = the Redis
--       server's clock), activity window (s), reserve fraction,
--       then the sequences this worker runs now: the number of tenants running here, the
--       sum of their counts, their ids and their counts (> 0), each list space-separated,
--       then, optionally (rule E below; '' or absent = off): the engine's prefill capacity and
--       KV capacity in tokens, and per running tenant (same order as the ids) its prompt
--       tokens not yet prefilled and its KV tokens held here, each list space-separated
--       then, optionally (claiming; '' or absent = off; ARGV[14..17] are then '' when rule E is
--       off): ARGV[18] the request hash's key prefix (+ id = req:{p.POOL}:id), ARGV[19] the
--       worker id, ARGV[20..] the transit payload fields to hand over and delete
-- Returns {{vtime, tenants still queued}, entry...} with effective tags; no entries when the
-- pool is empty or the next request does not fit. Claiming, each entry is followed by its
-- claim: {1, cancel reason or '', payload values...}, or {0, state} when the request can no
-- longer run.
--
-- Claim (what claim.lua did, now in the step that pops; ADR 0028):
-- K1 only a 'queued' request is claimed, and claiming flips it to 'running' (worker, in-flight
--    set, dispatched_at), so a settled (cancelled, expired) request is never started and no
--    request is started twice. One that is not 'queued' leaves its queue (it was settled while
--    queued) but does not enter the in-flight set (H3 holds: it is in neither).
-- K2 the payload (prompt ids, sampling, salt) is content in transit: it is deleted in the step
--    that hands it to the worker.
--
-- Head-of-line by tag: when the smallest-tag head does not fit the budget, stop rather than
-- skip to a smaller request, or large requests would starve behind a stream of small ones.
-- lookahead > 0 opts into considering that many further tenant heads (bounded skipping).
-- vtime = max(vtime, start tag of the request entering service) (start-time fair queueing,
-- Goyal et al.), so a tenant that was idle re-enters at the current virtual time.
-- The id leaves items and its queue and enters the worker's in-flight set in this one
-- script (H3): never in both, never dispatched twice, never dropped.
-- Cost per request: O(log tenants + log queue length).
--
-- Slot fairness (policy "wfq" with fair = '1'; "fifo" ignores it and stays plain FIFO).
-- A dispatched sequence holds its slot until it ends, so tag order alone lets a flood fill
-- every slot the moment the other tenants' queues are empty, and their next requests wait for
-- a long sequence to end. So each active tenant i has a fair share of this worker's slots,
--   cap_i = max(1, floor(slots * u_i / U)), slots = free + running here,
-- u_i = units(w_i) (the weight in integer units of 1e-6, common.lua), U = the sum of u over
-- the active tenants: those in seen (enqueued within the window; see pruning below) or in
-- heads (queued), which is the active hash (H7), and those running on this worker.
-- S1 a tenant below its cap may take a free slot (tag order as ever);
-- S2 a tenant at or over its cap may take one only if the free slots left after it are at
--    least the reserve: the other active tenants' unused shares, sum of max(0, cap_j - run_j),
--    but at most floor(fraction * slots), so a crowd of idle tenants cannot idle the worker;
-- S3 a lone active tenant has cap = slots: every slot (work-conserving); fraction 0 turns
--    S2 off (plain work-conserving WFQ).
-- S4 while every active tenant, and every tenant running here, has a request queued, S2 is
--    off: the reserve keeps room for tenants whose queue is momentarily empty, and a tenant
--    that is queued needs none, as tag order serves it at the next free slot. Caps would
--    otherwise fix shares in slots, and a tenant whose requests hold slots long for little
--    work (short prompts decoding beside others' long ones) could never get its share of
--    the service while all are backlogged (docs/fairness.md, "mixed lengths"). Checked at the
--    call's start (ZCARD active = ZCARD heads, as heads is within active; the running ids in
--    heads), it ends within the call when a dispatch empties a queue (nothing enqueues
--    during a call, so it never comes back within one). O(1) plus one ZMSCORE over R.
-- A tenant S2 blocks is skipped, not waited for: it already holds its share, so skipping it
-- cannot starve it, and its tags and vtime are untouched. Blocked tenants all run here
-- (cap >= 1), so the scan over heads is at most lookahead + 1 + the number of tenants running
-- here (read in chunks, as most picks stop at the first heads). The running counts come from
-- the worker (it knows its own sequences), so no shared counter exists that a crash, cancel
-- or reaped worker could leave wrong.
--
-- Cost: never a pass over the active tenants. S1-S3 are computed exactly (no approximation;
-- tests/test_wfq_properties.py compares every decision with a model that computes every cap
-- and the whole unused sum), from the H7 aggregates and what the pick looks at:
-- * A tenant that runs nothing here is below its cap (cap >= 1): S1 admits it with no cap.
-- * S2 needs the unused sum only as min(unused, reserve_max). With R the tenants running
--   here and O the other active ones, every cap >= 1 gives unused >= |O| >= |active| - |R|.
--   Large mode, |active| - |R| >= reserve_max + n: the reserve is reserve_max for the whole
--   call (each dispatch lowers unused by at most 1), and S2 is the same test for every
--   tenant, free - 1 >= reserve_max.
--   Small mode, otherwise: fewer than reserve_max + n + |R| <= 2 * slots + n tenants are
--   active, so the active zset is read whole and every cap and the unused sum are computed
--   as written above: O(slots), independent of the number of tenants in the pool.
-- * In large mode a cap is needed only for a running tenant the pick looks at while S2 fails.
--   U >= active_w (the sum over the active zset) and u <= umax (its largest score), so
--   cap <= max(1, floor(slots * umax / active_w)), and then <= max(1, floor(slots * u /
--   active_w)) with the tenant's own u (ZSCORE): a run count at either bound is at its cap,
--   with no U. With many tenants the first bound is 1 and a blocked head costs a table
--   look-up. Only otherwise is U made exact, once per call: active_w plus the weights of the
--   running tenants missing from active (one ZMSCORE over R).
-- So a call costs O(log tenants + lookahead + |R|): |R| <= slots for reading the worker's
-- counts and the blocked heads the pick skips, however many tenants the pool has.
-- Engine shares (rule E; docs/adr/0017). A slot is not the engine's unit of work: one tenant's
-- long prompts can hold the prefill budget and the KV cache with the share of slots S1-S3
-- give it. So a worker that passes its engine's state also keeps each active tenant within
-- its weighted share of both, with the same u and U as the slot caps:
--   pcap_i = max(1, floor(P * u_i / U)), kcap_i = max(1, floor(K * u_i / U)),
-- P the prefill tokens the engine computes over the dispatch horizon, K its KV cache.
-- E  a tenant with p_i prompt tokens waiting for prefill here and k_i KV tokens held here may
--    take a request only if p_i < pcap_i and k_i < kcap_i (it overshoots by one request at
--    most: a request is never refused for its own size, so a prompt longer than the share
--    still runs, alone). Within the call a taken request adds its kv_tokens to both (the
--    worker counts it so until the engine has its prompt length).
-- E1 a tenant with nothing pending and nothing held passes (p = k = 0 < caps >= 1): so it
--    only ever blocks tenants that run here, and the scan bound above still holds;
-- E2 a tenant alone (u_i = U) passes: all the capacity (work-conserving);
-- E3 E touches no tag, queue or vtime: it only skips a head, like S2 (H6 holds).
-- Cost: nothing for tenants that run nothing here; for a running one, U once per call (the
-- ZMSCORE exact_total does) and table look-ups.
-- * Pruning: seen members older than the window leave it (and active, unless queued), the
--   oldest PRUNE (128) per call at most, so one call's work stays bounded after a mass
--   expiry; each member is pruned once per enqueue, amortised O(log tenants). Members still
--   waiting to be pruned count as active (their shares are kept a call or two longer).
local inflight = KEYS[9]
local st = redis.call('HMGET', state, 'policy', 'vtime', 'active_w')  -- one read of state
local qprefix, policy = ARGV[1], st[1] or 'wfq'  -- as pool_policy()
local n, budget, lookahead = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local fair = ARGV[5] == '1' and policy == 'wfq'
local PRUNE, CHUNK = 128, 16

local vtime0 = tonumber(st[2] or '0')  -- as get_vtime()
local vtime = vtime0
local out = {''}

-- Slot fairness state. run: this worker's sequences per tenant (-position in the counts
-- until first read; counted up as this call dispatches); here: the ids running here, in
-- the order of the counts; u: weight units; cap: exact caps;
-- total: U once exact; active_w, umax: U's lower bound and the largest u in active (nil
-- until read); unused: the total unused share (small mode only). gone: tenants this call
-- took out of active (their queue emptied), which were in it when the call began.
local run, here, u, cap, gone, pos = {}, {}, {}, {}, {}, {}
local free, nrun, slots, reserve_max, small, backlogged = 0, 0, 0, 0, false, false
local active_w, total, umax, unused = 0, nil, nil, 0

-- Rule E's state: on when the worker passed its engine's capacities.
local engine = fair and (ARGV[14] or '') ~= ''
local pcap_total, kcap_total = tonumber(ARGV[14] or '0'), tonumber(ARGV[15] or '0')
-- per tenant: the worker's figures (its lists read only when a running tenant needs them),
-- plus what this call gave it
local pend, held, plist, hlist = {}, {}, nil, nil

local counts  -- the counts argument as a list, read on first need
local function running_count(tenant)
  local r = run[tenant]
  if r == nil then return 0 end
  if r < 0 then
    if not counts then
      counts = {}
      for c in string.gmatch(ARGV[13], '%d+') do counts[#counts + 1] = tonumber(c) end
    end
    r = counts[-r]
    run[tenant] = r
  end
  return r
end

-- U exact, as at the call's start: active_w plus the running tenants not in active.
local function exact_total()
  if total then return total end
  total = active_w
  if #here > 0 then
    local raw, missing = redis.call('ZMSCORE', active, unpack(here)), {}
    for k, t in ipairs(here) do
      if raw[k] then
        u[t] = tonumber(raw[k])
      elseif not gone[t] then
        missing[#missing + 1] = t
      end
    end
    if #missing > 0 then  -- running here only: active through this worker, not in H7
      local ws = redis.call('HMGET', weights, unpack(missing))
      for k, t in ipairs(missing) do
        u[t] = units(tonumber(ws[k]) or 1)
        total = total + u[t]
      end
    end
  end
  return total
end

-- Is this tenant, with r > 0 sequences here, below its cap? (Large mode; lazily.)
local function below_cap(tenant, r)
  if cap[tenant] then return r < cap[tenant] end
  if not total then  -- cap <= the bounds, as U >= active_w and u <= umax (read by allowed)
    if r >= math.max(1, math.floor(slots * umax / active_w)) then return false end
    u[tenant] = u[tenant] or tonumber(redis.call('ZSCORE', active, tenant) or '')
    if u[tenant] and r >= math.max(1, math.floor(slots * u[tenant] / active_w)) then
      return false
    end
  end
  local U = exact_total()
  u[tenant] = u[tenant] or units(tonumber(redis.call('HGET', weights, tenant) or '1'))
  cap[tenant] = math.max(1, math.floor(slots * u[tenant] / U))
  return r < cap[tenant]
end

if fair then
  free = tonumber(ARGV[6])
  local now, window, fraction = clock(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
  local cutoff = '(' .. fmt(now - window)
  local expired = redis.call('ZRANGEBYSCORE', seen, '-inf', cutoff, 'LIMIT', 0, PRUNE)
  if #expired > 0 then  -- H6, H7
    redis.call('ZREM', seen, unpack(expired))
    for _, t in ipairs(expired) do deactivate(t, heads) end
  end
  nrun, slots = tonumber(ARGV[10]), free + tonumber(ARGV[11])
  local k = 0
  for t in string.gmatch(ARGV[12], '[^ ]+') do
    k = k + 1
    run[t], pos[t], here[k] = -k, k, t
  end
  reserve_max = math.floor(fraction * slots + 1e-9)
  if reserve_max > 0 or engine then
    active_w = tonumber(st[3] or '0')  -- after pruning: read again if it changed it
    if #expired > 0 then active_w = tonumber(redis.call('HGET', state, 'active_w') or '0') end
  end
  if reserve_max > 0 then
    local nactive = redis.call('ZCARD', active)
    small = nactive - nrun < reserve_max + n
    backlogged = nactive == redis.call('ZCARD', heads)  -- S4
    if backlogged and #here > 0 then
      for _, score in ipairs(redis.call('ZMSCORE', heads, unpack(here))) do
        if not score then backlogged = false end
      end
    end
  end
  if small then  -- every cap and the whole unused sum, O(slots)
    local all = redis.call('ZRANGE', active, 0, -1, 'WITHSCORES')  -- < 2 * slots + n
    local U = exact_total()
    for i = 1, #all, 2 do
      local t = all[i]
      u[t] = tonumber(all[i + 1])
      cap[t] = math.max(1, math.floor(slots * u[t] / U))
      unused = unused + math.max(0, cap[t] - running_count(t))
    end
    for _, t in ipairs(here) do
      if not cap[t] then  -- running here only
        cap[t] = math.max(1, math.floor(slots * u[t] / U))
        unused = unused + math.max(0, cap[t] - running_count(t))
      end
    end
  end
end

-- E: the tenant's prefill pending and KV held here, as the worker passed them (0 if it runs
-- nothing here), plus what this call gave it.
local function engine_state(tenant)
  if pend[tenant] == nil then
    local i, p, h = pos[tenant], 0, 0
    if i then  -- it runs here: its figures are in the lists, at its position in the ids
      if not plist then
        plist, hlist = {}, {}
        for c in string.gmatch(ARGV[16] or '', '%d+') do plist[#plist + 1] = tonumber(c) end
        for c in string.gmatch(ARGV[17] or '', '%d+') do hlist[#hlist + 1] = tonumber(c) end
      end
      p, h = plist[i] or 0, hlist[i] or 0
    end
    pend[tenant], held[tenant] = p, h
  end
  return pend[tenant], held[tenant]
end

-- E, E1, E2: may this tenant take one more request within its engine shares?
local function engine_ok(tenant)
  if not engine then return true end
  local p, h = engine_state(tenant)
  if p == 0 and h == 0 then return true end  -- E1
  local U = exact_total()
  u[tenant] = u[tenant] or units(tonumber(redis.call('HGET', weights, tenant) or '1'))
  if u[tenant] >= U then return true end  -- E2: alone
  return p < math.max(1, math.floor(pcap_total * u[tenant] / U))
    and h < math.max(1, math.floor(kcap_total * u[tenant] / U))
end

-- Large mode with S2 failing (free - 1 < reserve_max): is every cap 1, i.e. slots * umax <
-- 2 * active_w? Then a tenant may take a slot iff it runs nothing here. umax is read once.
local one_slot_caps
local function only_idle_tenants()
  if not fair or reserve_max == 0 or small or backlogged or free - 1 >= reserve_max then
    return false
  end
  if one_slot_caps == nil then
    umax = tonumber(redis.call('ZRANGE', active, -1, -1, 'WITHSCORES')[2] or '1')
    one_slot_caps = math.floor(slots * umax / active_w) <= 1
  end
  return one_slot_caps
end

-- S1-S3: may this tenant take one more slot now?
local function allowed(tenant)
  if not fair or reserve_max == 0 or backlogged then return true end  -- S3, S4: no reserve
  if run[tenant] == nil then return true end  -- S1: it runs nothing here, and cap >= 1
  -- S2 (its own unused share is 0 at its cap). Large mode: unused >= reserve_max all call.
  if small then
    return running_count(tenant) < cap[tenant] or free - 1 >= math.min(unused, reserve_max)
  end
  if free - 1 >= reserve_max then return true end
  if only_idle_tenants() then return false end  -- at its cap of 1: it runs >= 1 here
  return below_cap(tenant, running_count(tenant))
end

-- The smallest-tag allowed head that fits, among the first lookahead + 1 + nrun heads.
local function pick()
  local considered, limit, from = 0, lookahead + nrun, 0
  local size = lookahead + 1 + math.min(nrun, CHUNK)
  local idle_only = only_idle_tenants()  -- then allowed(t) is run[t] == nil, inlined
  while from <= limit do
    local to = math.min(limit, from + size - 1)
    local batch = redis.call('ZRANGE', heads, from, to)
    for i = 1, #batch do
      local tenant = batch[i]
      if (idle_only and run[tenant] == nil)
          or (not idle_only and allowed(tenant) and engine_ok(tenant)) then
        local entry = redis.call('ZRANGE', qprefix .. tenant, 0, 0)[1]
        local item = parse(entry)
        if item.kv <= budget then return tenant, entry, item end
        considered = considered + 1
        if considered > lookahead then return nil end
      end
    end
    if #batch < to - from + 1 then return nil end  -- no more heads
    from, size = to + 1, size * 4
  end
  return nil
end

local claiming = (ARGV[18] or '') ~= ''
local claim_ms, payload = nil, {}
if claiming then
  for i = 20, #ARGV do payload[#payload + 1] = ARGV[i] end
end

-- K1, K2: hand one popped request to the worker; nil when it can no longer run.
local function claim(rid)
  local rk = ARGV[18] .. rid
  local st = redis.call('HGET', rk, 'state')
  if st ~= 'queued' then return {0, st or 'unknown'} end
  claim_ms = claim_ms or tostring(math.floor(clock('') * 1000))
  redis.call('HSET', rk, 'state', 'running', 'worker', ARGV[19], 'inflight', inflight,
             'dispatched_at', claim_ms)
  local values = redis.call('HMGET', rk, unpack(payload))
  redis.call('HDEL', rk, unpack(payload))
  local got = {1, redis.call('HGET', rk, 'cancel') or ''}
  for i = 1, #payload do got[#got + 1] = values[i] or '' end
  return got
end

local n_out = 0
while n_out < n do
  local tenant, entry, item = pick()
  if not tenant then break end
  if fair then
    local r = running_count(tenant)
    if r == 0 then nrun = nrun + 1 end
    -- small mode: its share is in use (every active tenant's cap is known; it is queued)
    if small and r < cap[tenant] then unused = unused - 1 end
    run[tenant] = r + 1
    free = free - 1
    if engine then  -- E: the request's KV, and its prompt until the worker knows it
      local p, h = engine_state(tenant)
      pend[tenant], held[tenant] = p + item.kv, h + item.kv
    end
  end
  local q, off = qprefix .. tenant, get_shift(tenant)
  redis.call('ZREM', q, entry)
  redis.call('HDEL', items, item.rid)
  if repair_head(q, tenant, policy) then gone[tenant], backlogged = true, false end  -- S4
  local claimed = claiming and claim(item.rid) or nil
  if not claimed or claimed[1] == 1 then redis.call('SADD', inflight, item.rid) end  -- H3, K1
  budget = budget - item.kv
  local start = item.start + off
  if start > vtime then vtime = start end
  out[#out + 1] = pack(item.finish + off, start, item)
  if claiming then out[#out + 1] = claimed end
  n_out = n_out + 1
end

if vtime > vtime0 then redis.call('HSET', state, 'vtime', fmt(vtime)) end  -- H4
-- out[1]: the pool's vtime and how many tenants still have a request queued. A worker that got
-- fewer than it asked for looks again on its own events (a slot or KV freed) only while some
-- are: with none, only a new admission's wake can give it work (ADR 0028, "local wakes").
out[1] = {fmt(vtime), redis.call('ZCARD', heads)}
return out
