-- status: a worker's record as workers() and stats() report it.
-- KEYS: the worker. Returns {incarnation, lease deadline, draining, entries, info, server
-- time in microseconds, blocks held}, or nil when the worker has no record. Reads only;
-- the server time comes along so the lease is measured on the clock that set it.
local record = redis.call('HMGET', KEYS[1], LEASE, DRAINING, ENTRIES, INFO,
  FASTEST[1], FASTEST[2], FASTEST[3], FASTEST[4])
local deadline, _, incarnation = decode_lease(record[1])
if not deadline then
  return nil
end
local blocks_held = 0
for i = 5, 8 do
  blocks_held = blocks_held + tonumber(record[i])
end
return {incarnation, integer_string(deadline), record[2], record[3], record[4],
  integer_string(now_us()), blocks_held}
