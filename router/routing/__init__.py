"""Routing: what the router believes about each worker, and the decision it makes."""
