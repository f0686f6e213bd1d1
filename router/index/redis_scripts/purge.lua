-- purge: drop a worker whose lease ran out more than a grace ago, with all its entries.
-- KEYS: the worker's group's roster, directory and retiring keys, then the worker.
-- ARGV: the grace in microseconds. Returns 1 when it dropped the worker, 0 when it
-- keeps it (alive, or within the grace: nothing changes), -1 when it has no record (its
-- id in the registry is a leftover).
-- Atomic, so of several routers purging at once exactly one reports each worker.
local index, deadline = read_member(WORKER)
if deadline and deadline + tonumber(ARGV[1]) > now_us() then
  return 0
end
if not index then
  redis.call('DEL', WORKER) -- not a member: no bit of it is in the directory
  return -1
end
retire(WORKER, index)
sweep_retired(SWEEP_BUDGET)
return 1
