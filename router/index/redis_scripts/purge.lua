-- purge: drop a worker whose lease ran out, with all its entries.
-- KEYS: the worker. Returns 1 when it dropped the worker, 0 when the worker is alive
-- (nothing changes), -1 when it has no record (its id in the registry is a leftover).
-- Atomic, so of several routers purging at once exactly one reports each worker.
local deadline = decode_lease(redis.call('HGET', KEYS[1], LEASE))
if deadline and deadline > now_us() then
  return 0
end
redis.call('DEL', KEYS[1])
return deadline and 1 or -1
