from collections.abc import Callable
from typing import Any, TypeVar

_Match = TypeVar("_Match", bound=tuple[object, ...])

RUN_STORE: int
RUN_REMOVE: int
RUN_CLEAR: int
MAX_SLOT: int  # the highest worker slot

class LocationTable:
    """Block key -> the worker slots holding it, per tier, and its depth (_table.c)."""

    def __init__(
        self,
        tiers: int,
        seed: int,
        *,
        match: type[_Match],
        by_tier: Callable[[tuple[int, ...]], object],
        capacity: int = 1024,
    ) -> None:
        """`match` builds a lookup's result per worker, from (worker id, incarnation,
        blocks, by_tier(blocks per tier)); a tuple subclass, filled as tuple.__new__
        fills one."""
    def apply(self, slot: int, runs: list[tuple[int, int, list[int], int]]) -> None:
        """Store, remove or clear, run by run: (kind, tier, keys, first position). Every
        run is checked first: ValueError and nothing applied if one is bad."""
    def clear(self, slot: int) -> None: ...
    def lookup(self, keys: list[int], names: list[tuple[str, int] | None]) -> dict[str, Any]:
        """{worker id: match} for every live slot holding keys[0]; names[slot] is a live
        slot's (worker id, incarnation), None for any other."""
    def evict_deepest(self, count: int) -> int: ...
    def slot_entries(self, slot: int) -> int: ...
    def depth(self, key: int) -> int | None: ...
    @property
    def entries(self) -> int: ...
    @property
    def keys(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
