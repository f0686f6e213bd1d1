-- register: record a worker's incarnation and start its lease.
-- KEYS: the worker's group's roster, directory and retiring keys, then the worker.
-- ARGV: incarnation (20 digits), lease in microseconds, grace in milliseconds, the
-- worker's info (JSON).
-- Returns {'ok', the sequence recorded for the incarnation ('0' when fresh)},
-- {'stale', current incarnation} or {'full'} (no member index left in the group).
local worker = WORKER
local incarnation, lease_us, grace_ms, info = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local now = now_us()
local deadline = now + lease_us

local index, _, search_tier, current = read_member(worker)
if current then
  local order = compare_incarnations(incarnation, current)
  if order < 0 then
    return {'stale', current}
  end
  if order == 0 and redis.call('EXISTS', worker) == 1 then
    -- A reconnect of the incarnation: keep its entries, its draining mark and its
    -- sequence, whose answer tells the agent whether they are all it sent. Its lease
    -- may have run out meanwhile (an index outage, a slow reconnect): until a router
    -- purges it, it has lost nothing, and resumes.
    redis.call('HSET', ROSTER, worker, encode_member(index, deadline, search_tier, incarnation))
    redis.call('HSET', worker, INFO, info)
    expire_member(worker, deadline, now, grace_ms)
    return {'ok', redis.call('HGET', worker, APPLIED) or '0'}
  end
end

-- New, newer, or the same incarnation after its lease ran out: start from nothing.
if not current then
  forget_stale_directory() -- a group without members holds nobody's bits
end
local fresh = free_index()
if not fresh then
  return {'full'}
end
if current then
  retire(worker, index)
else
  redis.call('DEL', worker) -- not a member: no bit of it is in the directory
end
redis.call('HSET', ROSTER, worker, encode_member(fresh, deadline, 0, incarnation))
redis.call('HSET', worker, DRAINING, '0', INFO, info, ENTRIES, '0', ORPHANS, '0', APPLIED, '0',
  FASTEST[1], '0', FASTEST[2], '0', FASTEST[3], '0', FASTEST[4], '0')
expire_member(worker, deadline, now, grace_ms)
sweep_retired(SWEEP_BUDGET)
return {'ok', '0'}
