"""Predicted locations: prefixes this router just sent to a worker, believed cached there
for a few seconds before the worker's own KV events confirm them.

Without them a burst of requests sharing a new prefix would all look uncached until
the first one's events arrived, and scatter. An entry expires after its time to live,
and goes at once when the index learns of a real removal from that worker (a removed
key, a cleared cache, a new incarnation or death): a prediction never outlives what
it predicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence


class PredictedPrefixes:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._holders: dict[int, dict[str, float]] = {}  # key -> worker -> expiry
        self._recorded: deque[tuple[float, str, Sequence[int]]] = deque()  # by expiry

    def __len__(self) -> int:
        return sum(len(holders) for holders in self._holders.values())

    def record(self, worker_id: str, keys: Sequence[int], now: float) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        self.prune(now)
        expiry = now + self.ttl_s
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = {worker_id: expiry}
            else:
                holders[worker_id] = expiry
        self._recorded.append((expiry, worker_id, keys))

    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per worker, how many of `keys`' leading blocks it is predicted to hold.

        A binary search per worker: a key names its whole prefix, and a prefix is
        recorded whole, its shorter part never expiring before its longer part, so a
        worker predicted to hold keys[i] is predicted to hold keys[:i] too. (A removal
        could punch a hole; engines evict a sequence's tail before its head, so the
        blocks after the hole go in the same removal or an earlier one.)"""
        first = self._holders.get(keys[0]) if keys else None
        if not first:
            return {}
        holders_of = self._holders.get
        matched: dict[str, int] = {}
        for worker, expiry in first.items():
            if expiry <= now:
                continue
            held, unknown = 1, len(keys)  # keys[:held] held; keys[unknown:] not known
            while held < unknown:
                middle = (held + unknown + 1) // 2
                holders = holders_of(keys[middle - 1])
                if holders is not None and holders.get(worker, 0.0) > now:
                    held = middle
                else:
                    unknown = middle - 1
            matched[worker] = held
        return matched

    def removed(self, worker_id: str, keys: Iterable[int]) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None and holders.pop(worker_id, None) is not None and not holders:
                del self._holders[key]

    def forget_worker(self, worker_id: str) -> None:
        for key in [key for key, holders in self._holders.items() if worker_id in holders]:
            self.removed(worker_id, (key,))

    def prune(self, now: float) -> None:
        """Drop entries whose time ran out (cheap: only the expired records are read)."""
        while self._recorded and self._recorded[0][0] <= now:
            expiry, worker_id, keys = self._recorded.popleft()
            for key in keys:
                holders = self._holders.get(key)
                # Only if not recorded again since, with a later expiry.
                if holders is not None and holders.get(worker_id) == expiry:
                    del holders[worker_id]
                    if not holders:
                        del self._holders[key]
