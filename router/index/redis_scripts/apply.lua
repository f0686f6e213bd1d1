-- apply: one event batch of one worker, in order, all of it or none.
-- KEYS: the worker's group's roster, directory and retiring keys, then the worker.
-- ARGV: incarnation (20 digits), grace in milliseconds, the batch, the batch's sequence
-- ('': none, nothing recorded or checked).
-- The batch is the events back to back, each a 9-byte header '<BBHI4B' (operation,
-- tier, depth of its first key, key count, parent kind), then for a stored run whose
-- parent kind is PARENT_KEY the parent's 8-byte key, then the 8-byte keys.
-- Returns {'ok', entries of the worker afterwards}, {'stale', current}, {'unknown'},
-- {'sequence', recorded} (the recorded sequence is not the one before this batch's) or
-- {'full'} (a clear needs a member index, and the group has none left).
-- Atomicity: the fence, the sequence check and the spare index are the only refusals,
-- and all run before the first write; the writes after them cannot fail (the script
-- carries no allow-oom flag, so an out-of-memory server refuses it before it starts).
local STORE, REMOVE, CLEAR = 1, 2, 3
local FIRST_BLOCK, PARENT_KEY = 0, 1 -- parent kinds; any other: parent unknown

local worker = WORKER
local now = now_us()
local sequence = ARGV[4]
local refusal, index, deadline = fence(worker, ARGV[1], now)
if not refusal and sequence ~= '' then
  refusal = check_applied(worker, integer_string(tonumber(sequence) - 1))
end
if refusal then
  return refusal
end
open_entries(worker, index)

local batch = ARGV[3]
local position, size = 1, #batch

local function next_fields(count)
  local fields = {}
  for i = 1, count do
    fields[i] = string.sub(batch, position, position + 7)
    position = position + 8
  end
  return fields
end

-- Decode the whole batch first, so that every block it names (and each stored run's
-- parent, and the recorded parent of each block it removes) is read in a few large
-- HMGETs rather than a few per event.
local events = {}
local named = {}
while position <= size do
  local operation, tier, depth, count, parent_kind
  operation, tier, depth, count, parent_kind, position = struct.unpack('<BBHI4B', batch, position)
  local event = {operation = operation, tier_bit = bit.lshift(1, tier - 1), depth = depth, parent = ''}
  if operation == STORE and parent_kind == PARENT_KEY then
    event.parent = next_fields(1)[1]
  elseif operation == STORE and parent_kind ~= FIRST_BLOCK then
    event.parent = UNKNOWN_PARENT
  end
  event.fields = next_fields(count)
  events[#events + 1] = event
  for i = 1, count do
    named[#named + 1] = event.fields[i]
  end
  if event.parent ~= '' then
    named[#named + 1] = event.parent
  end
end
load_entries(named)
load_parents(named)

-- A clear retires the member's entries under its index: the worker goes on under another.
local spare_index
for _, event in ipairs(events) do
  if event.operation == CLEAR then
    spare_index = free_index()
    if not spare_index then
      return {'full'}
    end
    break
  end
end

local cleared = false
-- Apply the events in order. The loads below find what the bulk loads above did not
-- foresee (blocks stored earlier in the batch under another parent; everything after a
-- clear): usually nothing, at no cost.
for _, event in ipairs(events) do
  local fields, tier_bit = event.fields, event.tier_bit
  if event.operation == CLEAR then
    clear_entries(spare_index)
    cleared = true
  elseif event.operation == STORE then
    -- The run is a chain: each key's parent is the key before it.
    local parent = event.parent
    load_entries(fields)
    load_entries({parent})
    for i = 1, #fields do
      store_entry(fields[i], tier_bit, event.depth + i - 1, parent)
      parent = fields[i]
    end
  elseif event.operation == REMOVE then
    load_entries(fields)
    load_parents(fields)
    for i = 1, #fields do
      local entry = entry_cache[fields[i]]
      if entry and bit.band(entry.mask, tier_bit) ~= 0 then
        set_mask(fields[i], entry, entry.mask - tier_bit)
      end
    end
  end
end

close_entries()
if sequence ~= '' then
  redis.call('HSET', worker, APPLIED, sequence)
end
-- After a clear too: that recreated the hash without a TTL.
expire_member(worker, deadline, now, tonumber(ARGV[2]))
if cleared then
  sweep_retired(SWEEP_BUDGET) -- the entries the clear retired, as far as it goes
end
return {'ok', counters.entries}
