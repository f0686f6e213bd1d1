-- Prepended to every kvplane index script by router/index/redis.py (a script cannot
-- include another). Layout and conventions: docs/redis-layout.md.
--
-- A worker is one hash. Its block entries are the fields of exactly 8 bytes (the block
-- key); its record is the fields below, whose names are never 8 bytes long.
local LEASE = 'meta.lease' -- '>dB' (lease deadline in server microseconds, search
-- tier) then the incarnation: what fencing and lookups read, in one field
local DRAINING = 'meta.draining' -- '1' once renewed with draining, else '0'
local INFO = 'meta.info' -- the WorkerInfo as JSON
local ENTRIES = 'meta.entries' -- (block, tier) entries held
local ORPHANS = 'meta.orphans' -- held blocks whose parent is not held (entries.lua)
local FASTEST = {'meta.tier1', 'meta.tier2', 'meta.tier3', 'meta.tier4'} -- blocks held,
-- by fastest tier
local APPLIED = 'meta.applied' -- decimal: the last batch sequence applied for the
-- incarnation, where its agent resumes through any router (absent in a hash an older
-- router wrote: then nothing is checked against it)
-- The search tier is the tier all the worker's blocks are fastest on when they are
-- closed under "parent of" (lookup.lua may then search them), else 0 (it walks them).
-- The incarnation is a 20-digit zero-padded decimal (a uint64 has at most 20 digits).

local function encode_lease(deadline, search_tier, incarnation)
  return struct.pack('>dB', deadline, search_tier) .. incarnation
end

-- deadline, search tier, incarnation; or nil when the worker has no record.
local function decode_lease(value)
  if not value then
    return nil
  end
  local deadline, search_tier = struct.unpack('>dB', value)
  return deadline, search_tier, string.sub(value, 10)
end

-- Lua numbers are doubles, exact only up to 2^53: compare incarnations by their two
-- 10-digit halves rather than as whole numbers.
local function compare_incarnations(a, b)
  if a == b then
    return 0
  end
  local high_a, high_b = tonumber(string.sub(a, 1, 10)), tonumber(string.sub(b, 1, 10))
  if high_a ~= high_b then
    return high_a < high_b and -1 or 1
  end
  return tonumber(string.sub(a, 11)) < tonumber(string.sub(b, 11)) and -1 or 1
end

-- The server's clock in microseconds: every router reads this one clock (a worker's
-- hash lives on one node), so routers agree on leases. Exact in a double until 2255.
local function now_us()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000000 + tonumber(time[2])
end

-- Redis turns Lua numbers into strings with "%.14g", which would round 16-digit
-- timestamps; integers are formatted here instead.
local function integer_string(number)
  return string.format('%.0f', number)
end

-- Whether `incarnation` may write to `worker`: the refusal to return (nil when it may),
-- then the lease deadline and search tier. The same rules as the memory index: no
-- record, or a newer incarnation than recorded -> unknown; an older one -> stale; the
-- current one with its lease run out -> unknown.
local function fence(worker, incarnation, now)
  local deadline, search_tier, current = decode_lease(redis.call('HGET', worker, LEASE))
  if not deadline then
    return {'unknown'}
  end
  local order = compare_incarnations(incarnation, current)
  if order < 0 then
    return {'stale', current}
  end
  if order > 0 or deadline <= now then
    return {'unknown'}
  end
  return nil, deadline, search_tier
end

-- Whether the worker's recorded sequence is `expected` (a decimal; '' checks nothing):
-- nil when it is (or none is recorded), else the refusal to return. A recorded
-- sequence behind the caller's means the server lost writes (a failover promoted a
-- replica that had not received them): the worker's entries cannot be vouched for.
local function check_applied(worker, expected)
  if expected == '' then
    return nil
  end
  local recorded = redis.call('HGET', worker, APPLIED)
  if recorded and tonumber(recorded) ~= tonumber(expected) then
    return {'sequence', recorded}
  end
  return nil
end

-- Keep the worker's hash until its lease has run out plus the grace period, so data
-- that no router purges (every router died) still goes away by itself.
local function expire_worker(worker, deadline, now, grace_ms)
  local ttl = math.ceil(math.max(deadline - now, 0) / 1000) + grace_ms
  redis.call('PEXPIRE', worker, integer_string(ttl))
end
