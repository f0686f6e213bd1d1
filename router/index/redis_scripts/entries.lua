-- Prepended (after common.lua) to the scripts that change a worker's entries: apply and
-- evict. Entries are decoded on first touch, changed in `entry_cache`, and written back
-- by close_entries() together with the worker's counters.
--
-- An entry field is the block key (8 bytes, little-endian). Its value is '>BHI4' (mask
-- of tiers held, depth, number of held children) followed by the parent: '' for a
-- first block (position 0), the parent's 8-byte key, or UNKNOWN_PARENT. A field whose
-- mask is 0 is a placeholder: a block the worker does not hold, kept only to count its
-- held children, which are orphans. The worker's ORPHANS counter (held blocks whose
-- parent it does not hold) is therefore exact; while it is 0 the worker's blocks are
-- closed under "parent of", and lookup.lua may search instead of walking.
local UNKNOWN_PARENT = 'unknown-parent' -- not 8 bytes: never held, so never adopted
local FASTEST_TIER = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1} -- lowest bit, by mask
local HELD_TIERS = {[0] = 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4} -- bits, by mask
local MAX_DEPTH = 65535
-- The value's format by the parent's length ('c' packs the parent whole: far cheaper
-- than concatenating it).
local VALUE_FORMAT = {[0] = '>BHI4', [8] = '>BHI4c8',
  [#UNKNOWN_PARENT] = '>BHI4c' .. #UNKNOWN_PARENT}

local worker_key
local member_index -- the worker's bit in its group's directory
local entry_cache = {} -- field -> {mask, depth, children, parent}, or false: absent
local dirty = {} -- field -> true for entries to write back
local flipped = {} -- field -> true for blocks that became held or stopped being held:
-- their bit in the directory is written back with them
local counters -- the worker's counters (ENTRIES, ORPHANS, FASTEST), as read and to write

local function open_entries(worker, index)
  worker_key = worker
  member_index = index
  local stored = redis.call('HMGET', worker, ENTRIES, ORPHANS, unpack(FASTEST))
  counters = {
    entries = tonumber(stored[1]),
    orphans = tonumber(stored[2]),
    fastest = {tonumber(stored[3]), tonumber(stored[4]), tonumber(stored[5]), tonumber(stored[6])},
  }
end

local function decode_entry(value)
  if not value then
    return false
  end
  local mask, depth, children = struct.unpack('>BHI4', value)
  return {mask = mask, depth = depth, children = children, parent = string.sub(value, 8)}
end

-- Read the fields not touched yet (one HMGET per CALL_CHUNK of them).
local function load_entries(fields)
  local missing = {}
  for i = 1, #fields do
    local field = fields[i]
    if entry_cache[field] == nil then
      entry_cache[field] = false
      missing[#missing + 1] = field
    end
  end
  for first = 1, #missing, CALL_CHUNK do
    local last = math.min(first + CALL_CHUNK - 1, #missing)
    local values = redis.call('HMGET', worker_key, unpack(missing, first, last))
    for i = first, last do
      entry_cache[missing[i]] = decode_entry(values[i - first + 1])
    end
  end
end

-- The loaded entry of `field`, created as an empty placeholder if absent.
local function touch_entry(field)
  local entry = entry_cache[field]
  if not entry then
    entry = {mask = 0, depth = 0, children = 0, parent = ''}
    entry_cache[field] = entry
  end
  dirty[field] = true
  return entry
end

-- `parent` (loaded) gained (+1) or lost (-1) a held child.
local function count_child(parent, delta)
  local entry = touch_entry(parent)
  entry.children = entry.children + delta
  if entry.mask == 0 then
    counters.orphans = counters.orphans + delta
  end
end

-- Give a loaded entry a new tier mask and keep every counter exact. `depth` and
-- `parent` are used when the block becomes held; its parent must be loaded, and when
-- the block stops being held, so must its recorded parent.
local function set_mask(field, entry, mask, depth, parent)
  local old = entry.mask
  counters.entries = counters.entries + HELD_TIERS[mask] - HELD_TIERS[old]
  if old ~= 0 then
    counters.fastest[FASTEST_TIER[old]] = counters.fastest[FASTEST_TIER[old]] - 1
  end
  if mask ~= 0 then
    counters.fastest[FASTEST_TIER[mask]] = counters.fastest[FASTEST_TIER[mask]] + 1
  end
  entry.mask = mask
  dirty[field] = true
  if (old == 0) ~= (mask == 0) then
    flipped[field] = true
  end
  if old == 0 then
    -- Now held: its held children stop being orphans, and it is a child of its parent.
    counters.orphans = counters.orphans - entry.children
    entry.depth = depth
    entry.parent = parent
    if parent ~= '' then
      count_child(parent, 1)
    end
  elseif mask == 0 then
    -- No longer held: its held children become orphans, its parent loses a child.
    counters.orphans = counters.orphans + entry.children
    if entry.parent ~= '' then
      count_child(entry.parent, -1)
    end
    entry.parent = ''
  end
end

local function store_entry(field, tier_bit, depth, parent)
  local entry = entry_cache[field]
  if not entry then
    -- A new block, the common case: set_mask() from an empty placeholder, spelled out
    -- because this runs for most stored keys.
    entry_cache[field] = {mask = tier_bit, depth = math.min(depth, MAX_DEPTH), children = 0,
      parent = parent}
    dirty[field] = true
    flipped[field] = true
    counters.entries = counters.entries + 1
    local fastest = FASTEST_TIER[tier_bit]
    counters.fastest[fastest] = counters.fastest[fastest] + 1
    if parent ~= '' then
      count_child(parent, 1)
    end
  elseif bit.band(entry.mask, tier_bit) == 0 then
    set_mask(field, entry, entry.mask + tier_bit, math.min(depth, MAX_DEPTH), parent)
  end
end

-- Load the recorded parents of the given (loaded) fields, before removing them.
local function load_parents(fields)
  local parents = {}
  for i = 1, #fields do
    local entry = entry_cache[fields[i]]
    if entry and entry.parent ~= '' then
      parents[#parents + 1] = entry.parent
    end
  end
  load_entries(parents)
end

local function call_chunked(command, arguments, step)
  for first = 1, #arguments, CALL_CHUNK * step do
    local last = math.min(first + CALL_CHUNK * step - 1, #arguments)
    redis.call(command, worker_key, unpack(arguments, first, last))
  end
end

local function flush_entries()
  local writes, removals = {}, {}
  for field in pairs(dirty) do
    local entry = entry_cache[field]
    if entry.mask ~= 0 or entry.children > 0 then
      writes[#writes + 1] = field
      writes[#writes + 1] = struct.pack(VALUE_FORMAT[#entry.parent], entry.mask, entry.depth,
        entry.children, entry.parent)
    else
      removals[#removals + 1] = field
    end
  end
  call_chunked('HSET', writes, 2)
  call_chunked('HDEL', removals, 1)
  dirty = {}
  local blocks, holding = {}, {}
  for field in pairs(flipped) do
    blocks[#blocks + 1] = field
    holding[#holding + 1] = entry_cache[field].mask ~= 0
  end
  update_directory(blocks, holding, member_index)
  flipped = {}
end

local retired_in_script = false

-- Forget every entry, keeping the worker's record: the entries written so far retire
-- with the member's index (their bits are swept later), and the worker takes
-- `spare_index`, free (the caller found it before its first write). Later clears in the
-- same script find nothing written under it yet: they only drop what is cached.
local function clear_entries(spare_index)
  if not retired_in_script then
    local record = redis.call('HMGET', worker_key, DRAINING, INFO, APPLIED)
    local _, deadline, search_tier, incarnation = read_member(worker_key)
    retire(worker_key, member_index)
    member_index = spare_index
    redis.call('HSET', ROSTER, worker_key,
      encode_member(spare_index, deadline, search_tier, incarnation))
    redis.call('HSET', worker_key, DRAINING, record[1], INFO, record[2])
    if record[3] then
      redis.call('HSET', worker_key, APPLIED, record[3])
    end
    retired_in_script = true
  end
  entry_cache, dirty, flipped = {}, {}, {}
  counters = {entries = 0, orphans = 0, fastest = {0, 0, 0, 0}}
end

-- Whether lookup.lua may search this worker's blocks: the tier they are all fastest
-- on when there is one and no block is an orphan, else 0.
local function search_tier()
  local only = 0
  for tier = 1, 4 do
    if counters.fastest[tier] > 0 then
      if only > 0 then
        return 0
      end
      only = tier
    end
  end
  return counters.orphans == 0 and only or 0
end

-- Write the entries and counters back, and the search tier into the member record.
local function close_entries()
  flush_entries()
  local _, deadline, _, incarnation = read_member(worker_key)
  redis.call('HSET', ROSTER, worker_key,
    encode_member(member_index, deadline, search_tier(), incarnation))
  local fastest = counters.fastest
  redis.call('HSET', worker_key,
    ENTRIES, integer_string(counters.entries), ORPHANS, integer_string(counters.orphans),
    FASTEST[1], integer_string(fastest[1]), FASTEST[2], integer_string(fastest[2]),
    FASTEST[3], integer_string(fastest[3]), FASTEST[4], integer_string(fastest[4]))
end
