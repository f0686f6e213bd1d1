"""Predicted locations: prefixes this router just sent to a worker, believed cached there
for a few seconds before the worker's own KV events confirm them.

Without them a burst of requests sharing a new prefix would all look uncached until
the first one's events arrived, and scatter. An entry expires after its time to live,
and goes at once when the index learns of a real removal from that worker (a removed
key, a cleared cache, a new incarnation or death): a prediction never outlives what
it predicted.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence

_COMPACT_FLOOR = 4096
"""A worker's map is cleared of expired entries once it holds this many, or twice what
it held after its last clearing: amortised, a key recorded costs one more visit."""


class PredictedPrefixes:
    """Kept per worker as key -> expiry, so that recording a prompt's prefix is one
    dict update in C (a loop over the keys cost about 75 ns a key: 150 µs for a
    32k-token prompt, on the path to the engine), and per first key the workers whose
    predictions start there, so that a request reads only those. Expired entries stay
    until their worker's last record expires (its whole map goes) or its map is
    compacted; until then match() reads their expiry and passes them by."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[str, dict[int, float]] = {}  # worker -> key -> expiry
        self._starts: dict[int, dict[str, float]] = {}  # first key -> worker -> expiry
        self._latest: dict[str, float] = {}  # worker -> its last record's expiry
        self._compact_at: dict[str, int] = {}  # worker -> its map's size that compacts it
        self._recorded: deque[tuple[float, str, int]] = deque()  # by expiry: first key
        self._pruned_at = -math.inf

    def __len__(self) -> int:
        """Entries unexpired at the last prune (for operators: a pass over every one)."""
        return sum(
            1
            for held in self._expiry.values()
            for expiry in held.values()
            if expiry > self._pruned_at
        )

    def record(self, worker_id: str, keys: Sequence[int], now: float) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        self.prune(now)
        expiry = now + self.ttl_s
        held = self._expiry.get(worker_id)
        if held is None:
            held = self._expiry[worker_id] = {}
        held.update(zip(keys, itertools.repeat(expiry)))
        starts = self._starts.get(keys[0])
        if starts is None:
            starts = self._starts[keys[0]] = {}
        starts[worker_id] = expiry
        self._latest[worker_id] = expiry
        self._recorded.append((expiry, worker_id, keys[0]))
        if len(held) >= self._compact_at.get(worker_id, _COMPACT_FLOOR):
            live = {key: until for key, until in held.items() if until > now}
            self._expiry[worker_id] = live
            self._compact_at[worker_id] = max(_COMPACT_FLOOR, 2 * len(live))

    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per worker, how many of `keys`' leading blocks it is predicted to hold.

        A binary search per worker: a key names its whole prefix, and a prefix is
        recorded whole, its shorter part never expiring before its longer part, so a
        worker predicted to hold keys[i] is predicted to hold keys[:i] too. (A removal
        could punch a hole; engines evict a sequence's tail before its head, so the
        blocks after the hole go in the same removal or an earlier one.)"""
        starting = self._starts.get(keys[0]) if keys else None
        if not starting:
            return {}
        matched: dict[str, int] = {}
        for worker in starting:
            held = self._expiry.get(worker)
            if held is None or held.get(keys[0], 0.0) <= now:
                continue
            expiry_of = held.get
            held_blocks, unknown = 1, len(keys)  # keys[:held_blocks] held; keys[unknown:] not known
            while held_blocks < unknown:
                middle = (held_blocks + unknown + 1) // 2
                if expiry_of(keys[middle - 1], 0.0) > now:
                    held_blocks = middle
                else:
                    unknown = middle - 1
            matched[worker] = held_blocks
        return matched

    def removed(self, worker_id: str, keys: Iterable[int]) -> None:
        held = self._expiry.get(worker_id)
        if held is not None:
            for key in keys:
                held.pop(key, None)

    def forget_worker(self, worker_id: str) -> None:
        self._expiry.pop(worker_id, None)
        self._latest.pop(worker_id, None)
        self._compact_at.pop(worker_id, None)

    def prune(self, now: float) -> None:
        """Drop what the records that expired by `now` leave behind: a worker's whole
        map once its last record has expired (cheap: only the expired records are read)."""
        self._pruned_at = max(self._pruned_at, now)
        while self._recorded and self._recorded[0][0] <= now:
            expiry, worker_id, first = self._recorded.popleft()
            starts = self._starts.get(first)
            # Only if not recorded again since, with a later expiry.
            if starts is not None and starts.get(worker_id) == expiry:
                del starts[worker_id]
                if not starts:
                    del self._starts[first]
            if self._latest.get(worker_id) == expiry:
                self.forget_worker(worker_id)
