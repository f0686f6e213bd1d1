-- drop: forget a worker and all its entries; with an incarnation, only while that is
-- still the worker's current one (a router acting on an old stream must not drop the
-- newer incarnation another router has registered since).
-- KEYS: the worker's group's roster, directory and retiring keys, then the worker.
-- ARGV: incarnation (20 digits), or '' for whichever is current.
-- Returns 1 when it dropped the worker, 0 when not (unknown, or another incarnation).
local index, _, _, current = read_member(WORKER)
if not current or (ARGV[1] ~= '' and compare_incarnations(ARGV[1], current) ~= 0) then
  return 0
end
retire(WORKER, index)
sweep_retired(SWEEP_BUDGET)
return 1
