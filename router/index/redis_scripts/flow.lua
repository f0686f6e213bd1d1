-- flow: flow control's exchange between router replicas (router/flow_control/shared.py),
-- one round trip each way. Every key is in the slot of the `{<prefix>:flow}` hash tag.
-- KEYS[1]: router id -> its state (opaque bytes); KEYS[2]: router id -> when its state
-- expires (server milliseconds); KEYS[3..]: one model's tenant -> virtual counter each.
-- ARGV: router id, state, its time to live in milliseconds, how long the counters are kept
-- idle (milliseconds); then per counter key: the number of steps, then each step in
-- order: tenant, amount to add, low and high bounds to bring it within ('' for none).
-- Returns {the routers' states, flat id/state pairs (this one's included), then per
-- counter key its flat tenant/counter pairs}.
local states, expiries = KEYS[1], KEYS[2]
local id, ttl, keep = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = math.floor(now_us() / 1000)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', expiries, '-inf', now)) do
  redis.call('HDEL', states, gone)
end
redis.call('ZREMRANGEBYSCORE', expiries, '-inf', now)
redis.call('HSET', states, id, ARGV[2])
redis.call('ZADD', expiries, now + ttl, id)
redis.call('PEXPIRE', states, ttl * 10)
redis.call('PEXPIRE', expiries, ttl * 10)
local reply = {redis.call('HGETALL', states)}
local at = 5
for k = 3, #KEYS do
  local counters = KEYS[k]
  local steps = tonumber(ARGV[at])
  at = at + 1
  for _ = 1, steps do
    local tenant = ARGV[at]
    if tonumber(ARGV[at + 1]) ~= 0 then
      redis.call('HINCRBYFLOAT', counters, tenant, ARGV[at + 1])
    end
    if ARGV[at + 2] ~= '' then
      local value = tonumber(redis.call('HGET', counters, tenant) or '0')
      local wanted = math.min(math.max(value, tonumber(ARGV[at + 2])), tonumber(ARGV[at + 3]))
      if wanted ~= value then
        redis.call('HSET', counters, tenant, tostring(wanted))
      end
    end
    at = at + 4
  end
  if steps > 0 then
    redis.call('PEXPIRE', counters, keep)
  end
  reply[#reply + 1] = redis.call('HGETALL', counters)
end
return reply
