"""Simulations: engines and fleets that behave like the real thing where a router cares."""
