-- holders: which of the given blocks this worker holds on any tier (for the estimate
-- of distinct keys in stats()).
-- KEYS: the worker. ARGV: block keys, 8 bytes each, back to back.
-- Returns one byte per key, 1 when held and 0 when not. Reads only.
local CHUNK = 1024 -- keys per HMGET: bounded by Lua's unpack() stack limit
local keys = ARGV[1]
local total = #keys / 8
local held = {}
local done = 0
while done < total do
  local count = math.min(CHUNK, total - done)
  local fields = {}
  for i = 1, count do
    local offset = (done + i - 1) * 8 + 1
    fields[i] = string.sub(keys, offset, offset + 7)
  end
  local values = redis.call('HMGET', KEYS[1], unpack(fields))
  for i = 1, count do
    -- a placeholder (mask 0, see entries.lua) is not held
    held[done + i] = (values[i] and string.byte(values[i]) ~= 0) and '\1' or '\0'
  end
  done = done + count
end
return table.concat(held)
