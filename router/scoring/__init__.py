"""Routing decisions: pure functions from what the router knows to a ranked choice."""
