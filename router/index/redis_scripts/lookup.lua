-- lookup: for each given worker, how long a prefix of the request's keys it holds, and
-- on which tiers.
-- ARGV: the request's keys (8 bytes each, back to back), then the workers' key names
-- separated by spaces (names have none: one argument the client builds with a join,
-- where a thousand names as arguments cost it about a millisecond to encode); or KEYS:
-- one worker (then ARGV holds only the request's keys). Workers passed in ARGV must all
-- live on this node: the caller groups workers by node, and the allow-cross-slot-keys
-- flag lets one call read many workers' slots (their keys cannot be declared: declared
-- keys must share one slot).
-- Returns one 40-byte record per worker, in order: '>I4I4I4I4I4' (matched blocks,
-- matched on DEVICE, HOST, DISK, REMOTE) and the 20-digit incarnation; 0 blocks when
-- the worker is unknown, its lease ran out, or it holds not even the first key. Reads
-- only. (One flat string: far cheaper for the client to parse than nested arrays.)
--
-- Every field read costs about as much as a call, so each worker is read with as few
-- fields as possible. One HMGET reads its record and the probes: the first key, and
-- the prefix length most often found so far in this call with the position after it
-- (workers that share a system prompt end at the same place, so for most workers this
-- one HMGET settles it). A worker whose lease names a search tier (its blocks are
-- closed under "parent of" and all fastest on that tier, see entries.lua) holds key i
-- only if it holds every key before it, so the probes bound the end of its prefix and a
-- binary search of single HGETs finds it. Any other worker is walked from the first
-- key in growing chunks up to its first miss, counting tiers.
local FASTEST_TIER = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1} -- lowest bit, by mask
local FIRST_CHUNK, MAX_CHUNK = 8, 1024
local NO_MATCH = struct.pack('>I4I4I4I4I4', 0, 0, 0, 0, 0) .. string.rep('0', 20)

local blob = ARGV[1]
local total = #blob / 8
local fields = {} -- position -> field, cut from the blob once for all workers
local function field_at(i)
  local field = fields[i]
  if not field then
    local offset = (i - 1) * 8 + 1
    field = string.sub(blob, offset, offset + 7)
    fields[i] = field
  end
  return field
end
local function held(value)
  return value and string.byte(value) ~= 0 -- a placeholder (mask 0) is not held
end

-- Walk from the first key to the first miss, counting tiers.
local function walk(worker)
  local matched, chunk = 0, FIRST_CHUNK
  local by_tier = {0, 0, 0, 0}
  while matched < total do
    local chosen = {}
    for i = matched + 1, math.min(matched + chunk, total) do
      chosen[#chosen + 1] = field_at(i)
    end
    local values = redis.call('HMGET', worker, unpack(chosen))
    for i = 1, #values do
      if not held(values[i]) then
        return matched, by_tier
      end
      local tier = FASTEST_TIER[string.byte(values[i])]
      by_tier[tier] = by_tier[tier] + 1
      matched = matched + 1
    end
    chunk = math.min(chunk * 4, MAX_CHUNK)
  end
  return matched, by_tier
end

-- The end of the prefix between `low` (held, or 0) and `high` (not held, or total + 1),
-- when holding key i implies holding keys 1..i.
local function bisect(worker, low, high)
  while high - low > 1 do
    local middle = math.floor((low + high) / 2)
    if held(redis.call('HGET', worker, field_at(middle))) then
      low = middle
    else
      high = middle
    end
  end
  return low
end

-- The probes: position 1, and the most often found length (the hint) and the one after
-- it; ascending and distinct. Rebuilt when the hint changes.
local found = {} -- prefix length -> workers found with it
local hint = 0
local probes, probe_fields
local function set_probes()
  probes = {1}
  for _, position in ipairs({hint, hint + 1}) do
    if position > probes[#probes] and position <= total then
      probes[#probes + 1] = position
    end
  end
  probe_fields = {}
  for i = 1, #probes do
    probe_fields[i] = field_at(probes[i])
  end
end
local function remember(length)
  found[length] = (found[length] or 0) + 1
  if length ~= hint and found[length] >= (found[hint] or 0) then
    hint = length
    set_probes()
  end
end

local function match(worker, now)
  local values = redis.call('HMGET', worker, LEASE, unpack(probe_fields))
  local deadline, search_tier, incarnation = decode_lease(values[1])
  -- values[1 + i] is the probe at probes[i]; probes[1] is the first key.
  if not deadline or deadline <= now or not held(values[2]) then
    return NO_MATCH
  end
  local matched, by_tier
  if search_tier > 0 then
    local low, high = 1, total + 1
    for i = 2, #probes do
      if not held(values[1 + i]) then
        high = probes[i]
        break
      end
      low = probes[i]
    end
    matched = bisect(worker, low, high)
    remember(matched)
    by_tier = {0, 0, 0, 0}
    by_tier[search_tier] = matched
  else
    matched, by_tier = walk(worker)
  end
  return struct.pack('>I4I4I4I4I4', matched, by_tier[1], by_tier[2], by_tier[3], by_tier[4])
    .. incarnation
end

set_probes()
local now = now_us()
local results = {}
if #KEYS > 0 then
  results[1] = match(KEYS[1], now)
else
  for name in string.gmatch(ARGV[2], '[^ ]+') do
    results[#results + 1] = match(name, now)
  end
end
return table.concat(results)
