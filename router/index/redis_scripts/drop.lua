-- drop: forget a worker and all its entries; with an incarnation, only while that is
-- still the worker's current one (a router acting on an old stream must not drop the
-- newer incarnation another router has registered since).
-- KEYS: the worker. ARGV: incarnation (20 digits), or '' for whichever is current.
-- Returns 1 when it dropped the worker, 0 when not (unknown, or another incarnation).
local _, _, current = decode_lease(redis.call('HGET', KEYS[1], LEASE))
if not current or (ARGV[1] ~= '' and compare_incarnations(ARGV[1], current) ~= 0) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
