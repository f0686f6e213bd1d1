"""A clock that moves only when the test moves it: leases, expiries and backoffs run out
at once instead of after a real wait (code under test takes a kvplane.core.clock.Clock)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
