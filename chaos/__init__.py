"""`kvplane chaos`: kill, partition and fault the fleet's real processes under load, and
check kvplane's promises (docs/reliability.md)."""
