-- status: a worker's record as workers() and stats() report it.
-- KEYS: as register.lua's. Returns {incarnation, lease deadline, draining,
-- entries, info, server time in microseconds, blocks held}, or nil when the worker has
-- no record. Reads only; the server time comes along so the lease is measured on the
-- clock that set it.
local _, deadline, _, incarnation = read_member(WORKER)
if not deadline then
  return nil
end
local record = redis.call('HMGET', WORKER, DRAINING, ENTRIES, INFO,
  FASTEST[1], FASTEST[2], FASTEST[3], FASTEST[4])
local blocks_held = 0
for i = 4, 7 do
  blocks_held = blocks_held + tonumber(record[i] or '0')
end
return {incarnation, integer_string(deadline), record[1] or '0', record[2] or '0',
  record[3] or '{}', integer_string(now_us()), blocks_held}
