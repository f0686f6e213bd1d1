-- register: record a worker's incarnation and start its lease.
-- KEYS: the worker. ARGV: incarnation (20 digits), lease in microseconds, grace in
-- milliseconds, the worker's info (JSON).
-- Returns {'ok', the sequence recorded for the incarnation ('0' when fresh)} or
-- {'stale', current incarnation}.
local worker = KEYS[1]
local incarnation, lease_us, grace_ms, info = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local now = now_us()
local deadline = now + lease_us

local current_deadline, search_tier, current = decode_lease(redis.call('HGET', worker, LEASE))
if current then
  local order = compare_incarnations(incarnation, current)
  if order < 0 then
    return {'stale', current}
  end
  if order == 0 then
    -- A reconnect of the incarnation: keep its entries, its draining mark and its
    -- sequence, whose answer tells the agent whether they are all it sent. Its lease
    -- may have run out meanwhile (an index outage, a slow reconnect): until a router
    -- purges it, it has lost nothing, and resumes.
    redis.call('HSET', worker, LEASE, encode_lease(deadline, search_tier, incarnation), INFO, info)
    expire_worker(worker, deadline, now, grace_ms)
    return {'ok', redis.call('HGET', worker, APPLIED) or '0'}
  end
end

-- New, newer, or the same incarnation after its lease ran out: start from nothing.
redis.call('DEL', worker)
redis.call('HSET', worker, LEASE, encode_lease(deadline, 0, incarnation), DRAINING, '0',
  INFO, info, ENTRIES, '0', ORPHANS, '0', APPLIED, '0',
  FASTEST[1], '0', FASTEST[2], '0', FASTEST[3], '0', FASTEST[4], '0')
expire_worker(worker, deadline, now, grace_ms)
return {'ok', '0'}
