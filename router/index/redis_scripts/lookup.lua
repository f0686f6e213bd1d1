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
-- Returns one string (far cheaper for the client to parse than nested arrays): per
-- group, in order, a section. Reads only.
--
-- Every field read costs about as much as a call, so a member is read with as few as
-- possible. Its record (index, lease, search tier, incarnation) comes from one HMGET of
-- its group's roster. A member whose record names a search tier (its blocks are closed
-- under "parent of" and all fastest on that tier, see entries.lua) holds key i only if
-- it holds every key before it, so the end of its prefix can be searched for (halving
-- ranges of positions); any other member is walked in its own hash from the first key in growing chunks up
-- to its first miss, counting tiers.
--
-- A group without a directory: 'R', then one 40-byte record per worker, in order:
-- '>I4I4I4I4I4' (matched blocks, matched on DEVICE, HOST, DISK, REMOTE) and the 20-digit
-- incarnation; 0 blocks when the worker is unknown, its lease ran out, or it holds not
-- even the first key. Each member is read in its own hash: first the probes (the first
-- key, and the prefix length most often found so far in this call with the position
-- after it: members that share a system prompt end at the same place, so for most
-- members the probes settle it), then its bisection.
--
-- A group with a directory: its members' roster records and the places where their
-- prefixes end, searched in the directory for the whole group at once
-- (match_directory_group); the router reads each member's match from them.
local FASTEST_TIER = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1} -- lowest bit, by mask
local FIRST_CHUNK, MAX_CHUNK = 8, 1024
local NO_MATCH = string.rep('\0', 20) .. string.rep('0', 20) -- 0 blocks, no incarnation
local ABSENT_MEMBER = string.rep('\0', MEMBER_HEADER + 20) -- no lease: never matched

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
local found = {} -- prefix length -> workers (with directories: groups) found ending there
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

-- The directory's bit sets at `positions` into `bits` ('' where no member holds the key).
local function read_bits(directory, positions, bits)
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
end

-- Where the group's prefixes end, found for all its members at once: flat triples of a
-- position p and the bit sets at p and p + 1 ('' past the request's keys). A searchable
-- member holds key i only if it holds every key before it, so its bit is set up to its
-- end and clear after: where the bit sets at two positions are equal (one compare:
-- Lua strings are interned) no searchable member ends between them. The spans where
-- they differ are halved, one HMGET a round for all of them, down to single steps. A
-- round reads a position per place some member ends, not one per member, and nothing
-- here is done per member: the router reads each member's end from its bit. The first
-- read is the probes (the place where ends were most common in the groups searched
-- before, and the position after it: members that share a system prompt end there in
-- every group, and the span before it then needs no halving) and the last position.
-- Also returns the bit sets read, by position.
local function find_ends(directory)
  local floor = math.floor
  local bits, ends = {}, {}
  if probed_hint ~= hint then
    set_probes()
  end
  local firsts = {unpack(probes)}
  if total > firsts[#firsts] then
    firsts[#firsts + 1] = total
  end
  read_bits(directory, firsts, bits)
  if bits[1] == '' then
    return ends, bits -- no member holds the first key
  end
  if bits[total] ~= '' then
    ends[1], ends[2], ends[3] = total, bits[total], ''
  end
  local spans = {} -- flat pairs low, high: some member may end in low .. high - 1
  for i = 2, #firsts do
    if bits[firsts[i - 1]] ~= bits[firsts[i]] then
      spans[#spans + 1], spans[#spans + 2] = firsts[i - 1], firsts[i]
    end
  end
  while #spans > 0 do
    local middles = {}
    for s = 1, #spans, 2 do
      local low, high = spans[s], spans[s + 1]
      if high - low == 1 then
        ends[#ends + 1], ends[#ends + 2], ends[#ends + 3] = low, bits[low], bits[high]
      else
        middles[#middles + 1] = floor((low + high) / 2)
      end
    end
    read_bits(directory, middles, bits)
    local halves = {}
    for s = 1, #spans, 2 do
      local low, high = spans[s], spans[s + 1]
      if high - low > 1 then
        local middle = floor((low + high) / 2)
        if bits[low] ~= bits[middle] then
          halves[#halves + 1], halves[#halves + 2] = low, middle
        end
        if bits[middle] ~= bits[high] then
          halves[#halves + 1], halves[#halves + 2] = middle, high
        end
      end
    end
    spans = halves
  end
  for e = 1, #ends, 3 do
    remember(ends[e])
  end
  return ends, bits
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

-- Append the section of a group with a directory: 'D', the server's clock ('>d'), the
-- members' records from the roster in the order asked (ABSENT_MEMBER for one not in
-- it), the ends (find_ends: a count '>I4', then per end its position '>I4' and the two
-- bit sets, each after its length '>H'), and the walked members (a count '>I4', then
-- each one's place in the group '>I4' and its record before the incarnation). Leases
-- and ends are read by the router (router/index/_lookup_reply.c): per member the script
-- only copies its record, and walks the rare member that cannot be searched.
local function match_directory_group(base, names, now, results)
  local ends, bits = find_ends(base .. ':directory')
  local first_bits = bits[1]
  local byte = string.byte
  results[#results + 1] = 'D' .. struct.pack('>d', now)
  local walked = {}
  for first = 1, #names, CALL_CHUNK do
    local last = math.min(first + CALL_CHUNK - 1, #names)
    local records = redis.call('HMGET', base .. ':roster', unpack(names, first, last))
    for i = first, last do
      local record = records[i - first + 1]
      if not record then
        record = ABSENT_MEMBER
      elseif byte(record, MEMBER_HEADER) == 0 then -- no search tier
        local index, deadline = decode_member(record)
        local held_byte, mask = math.floor(index / 8) + 1, bit.lshift(1, index % 8)
        if deadline > now and bit.band(byte(first_bits, held_byte) or 0, mask) ~= 0 then
          walked[#walked + 1] = struct.pack('>I4', i - 1) .. walk(names[i])
        end
      end
      results[#results + 1] = record
    end
  end
  results[#results + 1] = struct.pack('>I4', #ends / 3)
  for e = 1, #ends, 3 do
    local at_end, after_end = ends[e + 1], ends[e + 2]
    results[#results + 1] = struct.pack('>I4H', ends[e], #at_end)
    results[#results + 1] = at_end
    results[#results + 1] = struct.pack('>H', #after_end)
    results[#results + 1] = after_end
  end
  results[#results + 1] = struct.pack('>I4', #walked)
  results[#results + 1] = table.concat(walked)
end

-- Append the section of one group (a line of lookup's ARGV[2]) to `results`.
local function match_group(line, now, results)
  local names = {}
  for name in string.gmatch(line, '[^ ]+') do
    names[#names + 1] = name
  end
  local base = table.remove(names, 1)
  if has_directory(base) then
    match_directory_group(base, names, now, results)
  else
    results[#results + 1] = 'R'
    match_members(base, names, now, results)
  end
end

set_probes()
local now = now_us()
local results = {}
for line in string.gmatch(ARGV[2], '[^\n]+') do
  match_group(line, now, results)
end
return table.concat(results)
