"""Pure: the requests waiting for one model's engines, and who goes next.

Bands are strict: a higher band's request always goes before a lower one's. Within a
band, the tenant with the lowest virtual counter goes next (router/flow_control/
counters.py; ties to the earlier request). Within a tenant, the order is first come
first served, or earliest deadline first (requests without a deadline after those
with one, by arrival).

When the queue is full, the request shed is the newest of the lowest band's tenant that
would be most served once its waiting requests were, or the incoming request where
that is its own tenant (or its band is lower still): a flood sheds itself.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

Order = Literal["fcfs", "deadline"]
Counter = Callable[[str], float]  # a tenant's virtual counter


@dataclass(slots=True, eq=False)  # hashed by identity: one per request
class Waiting:
    """One request waiting here."""

    tenant: str
    band: int
    arrived_at: float  # on the router's clock
    deadline_at: float | None  # its first byte is due by then; None: no deadline
    seq: int  # arrival order
    cost: float  # what serving it is expected to add to its tenant's counter
    removed: bool = False


@dataclass(slots=True)
class _TenantLine:
    """One tenant's waiting requests in one band, in its serving order (a heap whose
    removed entries are skipped when they reach the top)."""

    heap: list[tuple[float, int, Waiting]] = field(default_factory=list)
    live: int = 0
    cost: float = 0.0  # of the live ones

    def head(self) -> Waiting | None:
        while self.heap and self.heap[0][2].removed:
            heapq.heappop(self.heap)
        return self.heap[0][2] if self.heap else None

    def newest(self) -> Waiting:
        return max((entry[2] for entry in self.heap if not entry[2].removed), key=_seq)


def _seq(waiting: Waiting) -> int:
    return waiting.seq


class ModelQueue:
    def __init__(self, order: Order = "fcfs") -> None:
        self._order = order
        self._bands: dict[int, dict[str, _TenantLine]] = {}
        self._seq = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def new(
        self, tenant: str, band: int, now: float, deadline_at: float | None, cost: float = 0.0
    ) -> Waiting:
        """A request about to wait (its arrival order taken; not queued yet)."""
        self._seq += 1
        return Waiting(tenant, band, now, deadline_at, self._seq, cost)

    def waits(self, tenant: str, band: int) -> bool:
        """Whether `tenant` has a request waiting in `band`."""
        return self.count(tenant, band) > 0

    def count(self, tenant: str, band: int) -> int:
        """How many requests `tenant` has waiting in `band`."""
        line = self._bands.get(band, {}).get(tenant)
        return 0 if line is None else line.live

    def backlogged(self, band: int) -> list[str]:
        """The tenants with requests waiting in `band`."""
        return [tenant for tenant, line in self._bands.get(band, {}).items() if line.live]

    def push(self, waiting: Waiting) -> None:
        line = self._bands.setdefault(waiting.band, {}).setdefault(waiting.tenant, _TenantLine())
        first = waiting.seq
        if self._order == "deadline":
            due = math.inf if waiting.deadline_at is None else waiting.deadline_at
        else:
            due = 0.0
        heapq.heappush(line.heap, (due, first, waiting))
        line.live += 1
        line.cost += waiting.cost
        self.size += 1

    def remove(self, waiting: Waiting) -> bool:
        """Takes `waiting` out (it left, or was shed); False if it was not waiting."""
        if waiting.removed:
            return False
        line = self._bands.get(waiting.band, {}).get(waiting.tenant)
        if line is None:
            return False
        waiting.removed = True
        line.live -= 1
        line.cost -= waiting.cost
        self.size -= 1
        if not line.live:
            del self._bands[waiting.band][waiting.tenant]
            if not self._bands[waiting.band]:
                del self._bands[waiting.band]
        return True

    def next(self, counter: Counter, skip: Collection[str] = ()) -> Waiting | None:
        """Who goes next (still queued: `remove` it), passing over the tenants in `skip`
        (None where the highest band has no one else)."""
        if not self._bands:
            return None
        band = max(self._bands)
        chosen: Waiting | None = None
        chosen_key = (math.inf, 0)
        for tenant, line in self._bands[band].items():
            if tenant in skip:
                continue
            head = line.head()
            assert head is not None  # lines without live entries are deleted
            key = (counter(tenant), head.seq)
            if key < chosen_key:
                chosen, chosen_key = head, key
        return chosen

    def victim(self, incoming: Waiting, counter: Counter) -> Waiting:
        """Whom to shed, the queue being full, for `incoming` (not queued yet): of the
        lowest band's tenants, the one whose counter would be highest once what it has
        waiting were served (its flood counts against it, not only what it was served)."""
        if not self._bands:
            return incoming
        band = min(self._bands)
        if incoming.band < band:
            return incoming
        lines = self._bands[band]

        def served_once_drained(tenant: str) -> float:
            line = lines.get(tenant)
            return counter(tenant) + (0.0 if line is None else line.cost)

        tenant = max(lines, key=lambda name: (served_once_drained(name), lines[name].live))
        if incoming.band == band and (
            incoming.tenant == tenant
            or served_once_drained(incoming.tenant) + incoming.cost >= served_once_drained(tenant)
        ):
            return incoming
        return lines[tenant].newest()

    def waiting(self) -> Iterator[Waiting]:
        """Every request waiting, in no order."""
        for lines in self._bands.values():
            for line in lines.values():
                yield from (entry[2] for entry in line.heap if not entry[2].removed)

    def tenants(self) -> dict[int, dict[str, int]]:
        """Requests waiting per band and tenant."""
        return {
            band: {tenant: line.live for tenant, line in lines.items()}
            for band, lines in self._bands.items()
        }

    def sizes(self) -> dict[int, int]:
        """Requests waiting per band."""
        return {
            band: sum(line.live for line in lines.values()) for band, lines in self._bands.items()
        }
