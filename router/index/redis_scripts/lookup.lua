-- lookup: for each given worker, how long a prefix of the request's keys it holds, and
-- on which tiers.
-- ARGV: the request's keys (8 bytes each, back to back), then the workers by group:
-- a line per group (separated by newlines) of the group's base name and its workers'
-- key names, separated by spaces (names have none: one argument the client builds with
-- a join, where a thousand names as arguments cost it about a millisecond to encode).
-- Every group passed must live on this node: the caller groups them by node, and the
-- allow-cross-slot-keys flag lets one call read many groups' slots (their keys cannot be
-- declared: declared keys must share one slot). KEYS are not read: a caller may declare
-- one group's roster, so that a cluster client routes the call to its node.
-- Returns one 40-byte record per worker, in order: '>I4I4I4I4I4' (matched blocks,
-- matched on DEVICE, HOST, DISK, REMOTE) and the 20-digit incarnation; 0 blocks when
-- the worker is unknown, its lease ran out, or it holds not even the first key. Reads
-- only. (One flat string: far cheaper for the client to parse than nested arrays.)
--
-- Every field read costs about as much as a call, so a member is read with as few as
-- possible. Its record (lease, search tier, incarnation) comes from one HMGET of its
-- group's roster. Then the probes: the first key, and the prefix length most often
-- found so far in this call with the position after it (members that share a system
-- prompt end at the same place, so for most members the probes settle it). A member
-- whose record names a search tier (its blocks are closed under "parent of" and all
-- fastest on that tier, see entries.lua) holds key i only if it holds every key before
-- it, so the probes bound the end of its prefix and a binary search finds it; any other
-- member is walked in its own hash from the first key in growing chunks up to its first
-- miss, counting tiers. Where the group keeps a directory, the probes and the searches
-- read it, for all the group's members at once (one HMGET of the directory a round);
-- otherwise each member's own hash.
local FASTEST_TIER = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1} -- lowest bit, by mask
local FIRST_CHUNK, MAX_CHUNK = 8, 1024
local NO_MATCH = string.rep('\0', 20) .. string.rep('0', 20) -- 0 blocks, no incarnation

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

-- A reply record before its incarnation: matched blocks, then matched per tier.
local function pack_record(matched, by_tier)
  return struct.pack('>I4I4I4I4I4', matched, by_tier[1], by_tier[2], by_tier[3], by_tier[4])
end

-- Walk from the first key to the first miss, counting tiers: the worker's reply record
-- before its incarnation.
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
        return pack_record(matched, by_tier)
      end
      local tier = FASTEST_TIER[string.byte(values[i])]
      by_tier[tier] = by_tier[tier] + 1
      matched = matched + 1
    end
    chunk = math.min(chunk * 4, MAX_CHUNK)
  end
  return pack_record(matched, by_tier)
end

-- The end of a worker's prefix between `low` (held, or 0) and `high` (not held, or
-- total + 1), when holding key i implies holding keys 1..i: in its own hash, for a
-- group without a directory.
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
-- it; ascending and distinct. Rebuilt when the hint has changed, before a group.
local found = {} -- prefix length -> workers found with it
local hint = 0
local probes, probe_fields, probed_hint
local function set_probes()
  probed_hint = hint
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
local function remember(length) -- the probes follow before they are next read
  found[length] = (found[length] or 0) + 1
  if length ~= hint and found[length] >= (found[hint] or 0) then
    hint = length
  end
end

-- A searched member's record before its incarnation, by (matched, search tier): made
-- once for all the members that end at the same place.
local searched_records = {}
local function searched_record(matched, search_tier)
  local key = matched * 8 + search_tier
  local record = searched_records[key]
  if not record then
    local by_tier = {0, 0, 0, 0}
    by_tier[search_tier] = matched
    record = pack_record(matched, by_tier)
    searched_records[key] = record
  end
  return record
end

-- Bisect the pending members all at once: member k holds the request's keys up to
-- somewhere in lows[k] .. highs[k] - 1 (lows[k] held, highs[k] not held or total + 1),
-- and has bit masks[k] in byte bytes[k] of a directory value. One HMGET of the
-- directory a round, at every unsettled member's middle. Leaves each end in lows[k].
-- (The hot loop of a fleet whose members end at many places: plain arrays.)
local function settle(directory, lows, highs, bytes, masks)
  local floor, band, byte = math.floor, bit.band, string.byte
  local unsettled = {}
  for k = 1, #lows do
    if highs[k] - lows[k] > 1 then
      unsettled[#unsettled + 1] = k
    end
  end
  while #unsettled > 0 do
    local middles, positions, asked = {}, {}, {}
    for u = 1, #unsettled do
      local k = unsettled[u]
      local middle = floor((lows[k] + highs[k]) / 2)
      middles[u] = middle
      if not asked[middle] then
        asked[middle] = true
        positions[#positions + 1] = middle
      end
    end
    local bits = {}
    for first = 1, #positions, CALL_CHUNK do
      local last = math.min(first + CALL_CHUNK - 1, #positions)
      local chosen = {}
      for j = first, last do
        chosen[#chosen + 1] = field_at(positions[j])
      end
      local values = redis.call('HMGET', directory, unpack(chosen))
      for j = first, last do
        bits[positions[j]] = values[j - first + 1] or ''
      end
    end
    local still = {}
    for u = 1, #unsettled do
      local k, middle = unsettled[u], middles[u]
      if band(byte(bits[middle], bytes[k]) or 0, masks[k]) ~= 0 then
        lows[k] = middle
      else
        highs[k] = middle
      end
      if highs[k] - lows[k] > 1 then
        still[#still + 1] = k
      end
    end
    unsettled = still
  end
end

-- Append the records of a group without a directory: each member read in its own hash.
local function match_members(base, names, now, results)
  for first = 1, #names, CALL_CHUNK do
    local last = math.min(first + CALL_CHUNK - 1, #names)
    local records = redis.call('HMGET', base .. ':roster', unpack(names, first, last))
    for i = first, last do
      local _, deadline, search_tier, incarnation = decode_member(records[i - first + 1])
      if not deadline or deadline <= now then
        results[#results + 1] = NO_MATCH
      else
        if probed_hint ~= hint then
          set_probes()
        end
        local worker = names[i]
        local values = redis.call('HMGET', worker, unpack(probe_fields))
        if not held(values[1]) then
          results[#results + 1] = NO_MATCH
        elseif search_tier == 0 then
          results[#results + 1] = walk(worker) .. incarnation
        else
          local low, high = 1, total + 1
          for j = 2, #probes do
            if not held(values[j]) then
              high = probes[j]
              break
            end
            low = probes[j]
          end
          local matched = bisect(worker, low, high)
          remember(matched)
          results[#results + 1] = searched_record(matched, search_tier) .. incarnation
        end
      end
    end
  end
end

-- Append the records of one group's workers (a line of lookup's ARGV[2]) to `results`.
-- Per member this is the hot path of every lookup: plain arrays, no table per member.
local function match_group(line, now, results)
  local names = {}
  for name in string.gmatch(line, '[^ ]+') do
    names[#names + 1] = name
  end
  local base = table.remove(names, 1)
  if not has_directory(base) then
    match_members(base, names, now, results)
    return
  end
  local directory = base .. ':directory'
  if probed_hint ~= hint then
    set_probes()
  end
  local probe_bits = redis.call('HMGET', directory, unpack(probe_fields))
  local first_bits = probe_bits[1] or ''
  local floor, band, byte, lshift = math.floor, bit.band, string.byte, bit.lshift
  -- The searchable members the probes left unsettled: where they are in `results`,
  -- their search tier and incarnation, the range of their end and their bit.
  local at, tiers, incarnations, lows, highs, bytes, masks = {}, {}, {}, {}, {}, {}, {}
  for first = 1, #names, CALL_CHUNK do
    local last = math.min(first + CALL_CHUNK - 1, #names)
    local records = redis.call('HMGET', base .. ':roster', unpack(names, first, last))
    for i = first, last do
      local index, deadline, search_tier, incarnation = decode_member(records[i - first + 1])
      local held_byte, mask
      if index then
        held_byte, mask = floor(index / 8) + 1, lshift(1, index % 8)
      end
      if not deadline or deadline <= now or band(byte(first_bits, held_byte) or 0, mask) == 0 then
        results[#results + 1] = NO_MATCH
      elseif search_tier > 0 then
        local low, high = 1, total + 1
        for j = 2, #probes do
          if band(byte(probe_bits[j] or '', held_byte) or 0, mask) == 0 then
            high = probes[j]
            break
          end
          low = probes[j]
        end
        if high - low <= 1 then
          remember(low)
          results[#results + 1] = searched_record(low, search_tier) .. incarnation
        else
          results[#results + 1] = false -- settled below
          local k = #lows + 1
          at[k], tiers[k], incarnations[k] = #results, search_tier, incarnation
          lows[k], highs[k], bytes[k], masks[k] = low, high, held_byte, mask
        end
      else
        results[#results + 1] = walk(names[i]) .. incarnation
      end
    end
  end
  settle(directory, lows, highs, bytes, masks)
  for k = 1, #lows do
    remember(lows[k])
    results[at[k]] = searched_record(lows[k], tiers[k]) .. incarnations[k]
  end
end

set_probes()
local now = now_us()
local results = {}
for line in string.gmatch(ARGV[2], '[^\n]+') do
  match_group(line, now, results)
end
return table.concat(results)
