-- purge: drop a worker whose lease ran out more than a grace ago, with all its entries.
-- KEYS: the worker. ARGV: the grace in microseconds. Returns 1 when it dropped the
-- worker, 0 when it keeps it (alive, or within the grace: nothing changes), -1 when it
-- has no record (its id in the registry is a leftover).
-- Atomic, so of several routers purging at once exactly one reports each worker.
local deadline = decode_lease(redis.call('HGET', KEYS[1], LEASE))
if deadline and deadline + tonumber(ARGV[1]) > now_us() then
  return 0
end
redis.call('DEL', KEYS[1])
return deadline and 1 or -1
