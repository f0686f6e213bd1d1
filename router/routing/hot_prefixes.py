"""The cached prefixes requests reuse most, for operators: each as the key of its last
block (a hash that names the whole prefix, never its text), its length and its tenant,
with how many requests matched it and the prompt tokens they could skip.

Counting every prefix ever matched would grow without bound; this keeps the heaviest:
when it holds twice its capacity it drops all but the `capacity` heaviest, so a prefix
that stays hot stays, and a count is exact while its prefix has never been dropped
(a prefix dropped and seen again starts over: it was not among the hottest).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvplane.core.keys import BlockKey


@dataclass(frozen=True, slots=True)
class HotPrefix:
    tenant: str
    key: BlockKey  # of the prefix's last block
    tokens: int  # its length
    requests: int  # requests whose prompt matched all of it
    reused_tokens: int  # tokens those requests could take from cache: requests x tokens


@dataclass(slots=True)
class _Count:
    tokens: int
    requests: int = 0


class HotPrefixes:
    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._counts: dict[tuple[str, BlockKey], _Count] = {}

    def matched(self, tenant: str, key: BlockKey, tokens: int) -> None:
        """A request's prompt matched the cached prefix ending with block `key`."""
        count = self._counts.get((tenant, key))
        if count is None:
            count = self._counts[(tenant, key)] = _Count(tokens)
            if len(self._counts) > 2 * self.capacity:
                self._keep_heaviest()
        count.requests += 1

    def top(self, n: int) -> list[HotPrefix]:
        """The `n` prefixes that saved the most prompt tokens, heaviest first."""
        heaviest = heapq.nlargest(
            n, self._counts.items(), key=lambda item: item[1].requests * item[1].tokens
        )
        return [
            HotPrefix(tenant, key, count.tokens, count.requests, count.requests * count.tokens)
            for (tenant, key), count in heaviest
        ]

    def __len__(self) -> int:
        return len(self._counts)

    def _keep_heaviest(self) -> None:
        kept = heapq.nlargest(
            self.capacity, self._counts.items(), key=lambda item: item[1].requests * item[1].tokens
        )
        self._counts = dict(kept)
