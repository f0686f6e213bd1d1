-- enlist: add a worker id to the registry and keep the registry at least as long as
-- that worker's keys (the registry expires only once every worker's keys could have).
-- KEYS: registry. ARGV: worker id, TTL in milliseconds.
redis.call('SADD', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[2])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
