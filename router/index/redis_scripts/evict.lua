-- evict: bring a worker that holds more entries than its share of max_entries back
-- under it, taking the deepest blocks of random samples.
-- KEYS: the worker's group's roster, directory and retiring keys, then the worker. ARGV: limit (evict only above it), target (evict down to it),
-- sample size, budget (most entries to evict in this call, so one call never blocks
-- the server for long; the caller calls again while the worker is above the target).
-- Returns {entries evicted, entries left}.
-- Each round draws a sample of distinct fields (HRANDFIELD), orders the held blocks in
-- it deepest first (at equal depth, leaves first: evicting a block without held
-- children keeps the worker's blocks closed under "parent of", see entries.lua), and
-- evicts the first eighth of them, every tier of each chosen block at once.
local EVICTED_SHARE = 8 -- evict the first 1/8 of each sample: the smaller the share,
-- the closer to "deepest first" (and the more samples drawn per block evicted)
local MAX_ROUNDS = 1000 -- a sample may hold no block, only placeholders: do not spin
local worker = WORKER
local limit, target = tonumber(ARGV[1]), tonumber(ARGV[2])
local sample_size, budget = tonumber(ARGV[3]), tonumber(ARGV[4])

local index = read_member(worker)
if not index or redis.call('EXISTS', worker) == 0 then
  return {0, 0} -- dropped, purged or expired since the apply that asked for room
end
open_entries(worker, index)
if counters.entries <= limit then
  return {0, counters.entries}
end
local evicted, rounds = 0, 0
while counters.entries > target and evicted < budget and rounds < MAX_ROUNDS do
  rounds = rounds + 1
  local drawn = redis.call('HRANDFIELD', worker, sample_size, 'WITHVALUES')
  local sample = {}
  for i = 1, #drawn, 2 do
    local field = drawn[i]
    if #field == 8 then -- a block, not a field of the worker's record
      if entry_cache[field] == nil then
        entry_cache[field] = decode_entry(drawn[i + 1])
      end
      sample[#sample + 1] = field
    end
  end
  local candidates = {}
  for i = 1, #sample do
    local entry = entry_cache[sample[i]]
    if entry and entry.mask ~= 0 then
      candidates[#candidates + 1] = {field = sample[i], entry = entry, leaf = entry.children == 0}
    end
  end
  table.sort(candidates, function(a, b)
    if a.entry.depth ~= b.entry.depth then
      return a.entry.depth > b.entry.depth
    end
    return a.leaf and not b.leaf
  end)
  local victims = {}
  for i = 1, math.ceil(#candidates / EVICTED_SHARE) do
    victims[i] = candidates[i].field
  end
  load_parents(victims)
  for i = 1, #victims do
    if counters.entries <= target then
      break
    end
    local entry = entry_cache[victims[i]]
    evicted = evicted + HELD_TIERS[entry.mask]
    set_mask(victims[i], entry, 0)
  end
  -- Written back every round: the next HRANDFIELD must not draw what this one evicted.
  flush_entries()
end
close_entries()
return {evicted, counters.entries}
