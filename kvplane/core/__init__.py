"""kvplane's shared core, the bottom layer: block keys, the domain types the router and
the agents share, settings and flags, tokenisation rules, serving helpers. It imports
nothing else of kvplane's (docs/architecture.md, "Layers")."""
