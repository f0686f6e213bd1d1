-- Prepended to every kvplane index script by router/index/redis.py (a script cannot
-- include another). Layout and conventions: docs/redis-layout.md.
--
-- Workers are placed in groups; each group's keys share one hash tag, so one script
-- may write any of them (one slot of a cluster). Named from the group's base
-- `<prefix>:{<tag>}`:
--   `<base>:w:<worker id>` (hash) a worker's record and entries: the fields of exactly
--     8 bytes are block keys (entries.lua); the record's names are never 8 bytes long;
--   `<base>:roster` (hash) worker key -> member record (below): who is in the group;
--   `<base>:directory` (hash) block key -> bit set of the members holding it, by index,
--     in a layout with directories only (a tag that ends in 'd.<n>');
--   `<base>:retiring` (hash) member index -> how far the sweep of its old entries has
--     come: they wait in `<base>:retired:<index>` to be cleared from the directory, or
--     were lost and the directory is scanned (sweep_retired below); the index is
--     reused after.
-- Scripts get KEYS: the group's roster, directory and retiring keys, then (those about
-- one worker) the worker's.
local ROSTER, DIRECTORY, RETIRING, WORKER = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local DRAINING = 'meta.draining' -- '1' once renewed with draining, else '0'
local INFO = 'meta.info' -- the WorkerInfo as JSON
local ENTRIES = 'meta.entries' -- (block, tier) entries held
local ORPHANS = 'meta.orphans' -- held blocks whose parent is not held (entries.lua)
local FASTEST = {'meta.tier1', 'meta.tier2', 'meta.tier3', 'meta.tier4'} -- blocks held,
-- by fastest tier
local APPLIED = 'meta.applied' -- decimal: the last batch sequence applied for the
-- incarnation, where its agent resumes through any router (absent in a hash an older
-- router wrote: then nothing is checked against it)
-- A member record, '>HdB' then the incarnation: the member's index (its bit in the
-- directory), lease deadline (server microseconds, as a double: exact until 2255) and
-- search tier. The one value fencing and lookups read. The search tier is the tier all
-- the worker's blocks are fastest on when they are closed under "parent of" (lookup.lua
-- may then search them), else 0 (it walks them). The incarnation is a 20-digit
-- zero-padded decimal (a uint64 has at most 20 digits).
local MEMBER_FORMAT = '>HdB'
local MEMBER_HEADER = 11 -- bytes before the incarnation
local MAX_MEMBERS = 65536 -- indexes are 16 bits

local function encode_member(index, deadline, search_tier, incarnation)
  return struct.pack(MEMBER_FORMAT, index, deadline, search_tier) .. incarnation
end

-- index, deadline, search tier, incarnation; or nil when `value` is none.
local function decode_member(value)
  if not value then
    return nil
  end
  local index, deadline, search_tier = struct.unpack(MEMBER_FORMAT, value)
  return index, deadline, search_tier, string.sub(value, MEMBER_HEADER + 1)
end

local function read_member(worker)
  return decode_member(redis.call('HGET', ROSTER, worker))
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
-- then the member's index, lease deadline and search tier. The same rules as the memory
-- index: no record, or a newer incarnation than recorded -> unknown; an older one ->
-- stale; the current one with its lease run out -> unknown.
local function fence(worker, incarnation, now)
  local index, deadline, search_tier, current = read_member(worker)
  if not index then
    return {'unknown'}
  end
  local order = compare_incarnations(incarnation, current)
  if order < 0 then
    return {'stale', current}
  end
  if order > 0 or deadline <= now then
    return {'unknown'}
  end
  return nil, index, deadline, search_tier
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

local CALL_CHUNK = 1024 -- fields per HMGET/HSET/HDEL: bounded by Lua's unpack() limit

local GROUP = ROSTER and string.sub(ROSTER, 1, -#':roster' - 1)
-- Whether the group keeps a directory: the layout says so in the group's tag, so that a
-- script never writes a directory its lookups would not read (or the reverse).
local function has_directory(group)
  return string.find(group, 'd%.%d+}$') ~= nil
end
local WITH_DIRECTORY = GROUP ~= nil and has_directory(GROUP)

local function retired_key(index)
  return GROUP .. ':retired:' .. index
end

local function extend_ttl(key, ttl)
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end

-- Keep the worker's hash until its lease has run out plus the grace period, and its
-- group's keys at least as long, so data that no router purges (every router died)
-- still goes away by itself. The group's keys share one expiry, the roster's: a
-- directory must never outlive the roster that says whose its bits are (an index
-- would be given out again with bits set). Extended by a quarter more than needed, so
-- that not every write of every member extends it.
local function expire_member(worker, deadline, now, grace_ms)
  local ttl = math.ceil(math.max(deadline - now, 0) / 1000) + grace_ms
  redis.call('PEXPIRE', worker, integer_string(ttl))
  local roster_ttl = redis.call('PTTL', ROSTER)
  local extended = roster_ttl < ttl
  if extended then
    roster_ttl = math.ceil(ttl * 1.25)
    redis.call('PEXPIRE', ROSTER, integer_string(roster_ttl))
  end
  if WITH_DIRECTORY then
    for _, key in ipairs({DIRECTORY, RETIRING}) do
      local left = redis.call('PTTL', key)
      -- -1: made since the roster's last extension, without an expiry of its own
      if left ~= -2 and (extended or left == -1) then
        redis.call('PEXPIRE', key, integer_string(roster_ttl))
      end
    end
  end
end

-- Before a group without members takes one: whatever its directory still holds is
-- stale (the roster that said whose the bits are expired or emptied), so it goes, with
-- the sweeps that were left.
local function forget_stale_directory()
  if not WITH_DIRECTORY or redis.call('EXISTS', ROSTER) == 1 then
    return
  end
  local retiring = redis.call('HKEYS', RETIRING)
  for i = 1, #retiring do
    redis.call('UNLINK', retired_key(retiring[i]))
  end
  redis.call('UNLINK', DIRECTORY, RETIRING)
end

-- The directory: one bit set per block, a bit per member index, lowest index in the
-- first byte's lowest bit; trailing zero bytes are trimmed, so an empty set is ''.
local function with_bit(bits, index, holding)
  local at = math.floor(index / 8) + 1
  if #bits < at then
    if not holding then
      return bits
    end
    bits = bits .. string.rep('\0', at - #bits)
  end
  local byte, mask = string.byte(bits, at), bit.lshift(1, index % 8)
  byte = holding and bit.bor(byte, mask) or bit.band(byte, bit.bnot(mask))
  bits = string.sub(bits, 1, at - 1) .. string.char(byte) .. string.sub(bits, at + 1)
  local last = #bits
  while last > 0 and string.byte(bits, last) == 0 do
    last = last - 1
  end
  return string.sub(bits, 1, last)
end

-- Set member `index`'s bit for blocks[i] where holding[i], clear it elsewhere (in a
-- group with a directory).
local function update_directory(blocks, holding, index)
  if not WITH_DIRECTORY then
    return
  end
  for first = 1, #blocks, CALL_CHUNK do
    local last = math.min(first + CALL_CHUNK - 1, #blocks)
    local current = redis.call('HMGET', DIRECTORY, unpack(blocks, first, last))
    local writes, removals = {}, {}
    for i = first, last do
      local before = current[i - first + 1] or ''
      local after = with_bit(before, index, holding[i])
      if after ~= before then
        if after == '' then
          removals[#removals + 1] = blocks[i]
        else
          writes[#writes + 1] = blocks[i]
          writes[#writes + 1] = after
        end
      end
    end
    if #writes > 0 then
      redis.call('HSET', DIRECTORY, unpack(writes))
    end
    if #removals > 0 then
      redis.call('HDEL', DIRECTORY, unpack(removals))
    end
  end
end

-- The lowest member index neither a member's nor still being swept; nil when none is
-- left (MAX_MEMBERS in one group).
local function free_index()
  local used = {}
  local records = redis.call('HVALS', ROSTER)
  for i = 1, #records do
    used[struct.unpack('>H', records[i])] = true
  end
  local retiring = redis.call('HKEYS', RETIRING)
  for i = 1, #retiring do
    used[tonumber(retiring[i])] = true
  end
  local index = 0
  while used[index] do
    index = index + 1
  end
  return index < MAX_MEMBERS and index or nil
end

-- Take the worker out of its group: its entries wait under its index until
-- sweep_retired() has cleared their bits from the directory; the index is reused after.
-- (A whole cache at once would block the server for as long as it has blocks.)
local function retire(worker, index)
  redis.call('HDEL', ROSTER, worker)
  local directory_ttl = redis.call('PTTL', DIRECTORY)
  if directory_ttl == -2 then
    redis.call('DEL', worker) -- no directory: no bit to clear
    return
  end
  if redis.call('EXISTS', worker) == 1 then
    redis.call('RENAME', worker, retired_key(index))
    extend_ttl(retired_key(index), directory_ttl)
    redis.call('HSET', RETIRING, index, 'h0')
  else
    -- Its entries expired before it was purged: its bits are found by a scan of the
    -- whole directory instead.
    redis.call('HSET', RETIRING, index, 'd0')
  end
  extend_ttl(RETIRING, directory_ttl) -- the group's expiry (expire_member)
end

local SWEEP_SCAN = 256 -- fields per HSCAN
local SWEEP_BUDGET = 1024 -- fields one script sweeps at most: bounds how long it blocks

-- Clear retired members' bits from the directory, about `budget` fields' worth at
-- most (each call blocks the server only so long); returns whether any remain. A
-- retiring index records what to scan next: 'h' and a cursor over its retired entries
-- (each batch deleted once cleared), or 'd' and a cursor over the whole directory.
local function sweep_retired(budget)
  local retiring = redis.call('HGETALL', RETIRING)
  for i = 1, #retiring, 2 do
    local index, progress = tonumber(retiring[i]), retiring[i + 1]
    local retired = retired_key(index)
    local source = string.sub(progress, 1, 1) == 'h' and retired or DIRECTORY
    if source == retired and redis.call('EXISTS', retired) == 0 then
      source, progress = DIRECTORY, 'd0' -- expired meanwhile: scan the directory
    end
    while budget > 0 do
      local reply = redis.call('HSCAN', source, string.sub(progress, 2), 'COUNT', SWEEP_SCAN)
      local fields, blocks, holding = {}, {}, {}
      for j = 1, #reply[2], 2 do
        local field = reply[2][j]
        fields[#fields + 1] = field
        -- In the retired entries only held blocks have a bit (a placeholder, mask 0,
        -- has none); in the directory every field may.
        if #field == 8 and (source == DIRECTORY or string.byte(reply[2][j + 1]) ~= 0) then
          blocks[#blocks + 1] = field
          holding[#holding + 1] = false
        end
      end
      update_directory(blocks, holding, index)
      if source == retired and #fields > 0 then
        for first = 1, #fields, CALL_CHUNK do
          redis.call('HDEL', retired, unpack(fields, first, math.min(first + CALL_CHUNK - 1, #fields)))
        end
      end
      budget = budget - math.max(#fields, 1)
      progress = string.sub(progress, 1, 1) .. reply[1]
      if reply[1] == '0' then
        redis.call('DEL', retired)
        redis.call('HDEL', RETIRING, index)
        break
      end
    end
    if budget <= 0 then
      if redis.call('HEXISTS', RETIRING, index) == 1 then
        redis.call('HSET', RETIRING, index, progress)
      end
      return redis.call('HLEN', RETIRING) > 0
    end
  end
  return false
end
