"""The worker agent: beside one engine replica, the control plane's only source of truth
about that replica's cache and load."""
