-- sweep: clear the bits of members that left the group from its directory, a bounded
-- amount at a time (common.lua, sweep_retired).
-- KEYS: the group's roster, directory and retiring keys. Returns 1 while some remain.
return sweep_retired(SWEEP_BUDGET) and 1 or 0
