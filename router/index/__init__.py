"""The location index: which worker holds which block (see base.py for the contract)."""

from __future__ import annotations

import time

from kvplane.core.clock import Clock
from kvplane.core.config import IndexSettings
from router.index.base import LocationIndex
from router.index.memory import MemoryLocationIndex


def open_index(settings: IndexSettings, clock: Clock = time.monotonic) -> LocationIndex:
    """The backend the settings name; Redis is imported only when asked for."""
    if settings.backend == "memory":
        return MemoryLocationIndex(max_entries=settings.max_entries, clock=clock)
    from router.index.redis import RedisLocationIndex

    return RedisLocationIndex.from_url(
        settings.redis_url,
        cluster=settings.backend == "redis-cluster",
        prefix=settings.redis_prefix,
        groups=settings.redis_groups,
        directory=settings.redis_directory,
        max_entries=settings.max_entries,
        clock=clock,
    )
