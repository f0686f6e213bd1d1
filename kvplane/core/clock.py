"""The clock that decisions read: leases, expiries, backoffs, predicted entries, ages.

Code that decides by time takes a `Clock` (defaulting to `time.monotonic`) instead of
calling the time module inline, so that one process reads one clock throughout and a
test can drive it by hand (tests/clock.py) instead of sleeping until a lease runs out.
Durations that are only measured (metrics, `Decision.seconds`) keep `time.perf_counter`.
"""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
"""Seconds on a clock that never goes back (`time.monotonic` unless a test injects one);
only differences between two readings of the same clock mean anything."""

WallClock = Callable[[], float]
"""Seconds since the Unix epoch (`time.time`): what agents' timestamps are compared to."""
