-- renew: the heartbeat; extend the lease to now + lease (0 ends it now) and optionally
-- mark the worker as draining (a mark that stays until the next registration).
-- KEYS: the worker's group's roster, directory and retiring keys, then the worker.
-- ARGV: incarnation (20 digits), lease in microseconds, grace in milliseconds, '1' to
-- mark draining else '0', the sequence the caller last applied ('' checks none).
-- Returns {'ok'}, {'stale', current incarnation}, {'unknown'} or {'sequence', recorded}.
local worker = WORKER
local now = now_us()
local refusal, index, _, search_tier = fence(worker, ARGV[1], now)
refusal = refusal or check_applied(worker, ARGV[5])
if refusal then
  return refusal
end
local deadline = now + tonumber(ARGV[2])
redis.call('HSET', ROSTER, worker, encode_member(index, deadline, search_tier, ARGV[1]))
if ARGV[4] == '1' then
  redis.call('HSET', worker, DRAINING, '1')
end
expire_member(worker, deadline, now, tonumber(ARGV[3]))
return {'ok'}
