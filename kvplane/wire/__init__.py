"""The wire contract in Python, one layer above the core: the stubs generated from
proto/kvplane/wire/v1/, the one codec between domain objects and messages, and the
agent's side of the Connect stream."""
