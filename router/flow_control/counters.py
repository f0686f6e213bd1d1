"""Virtual token counters: how much service each tenant has had of a model, in tokens
weighted by cost and divided by the tenant's share (VTC, Sheng et al., OSDI'24). The
backlogged tenant with the lowest counter is served next, so over any stretch where
tenants are backlogged their service follows their shares, whatever their requests cost.

Counters only rise, except where a tenant starts waiting: it is brought within the
counters of the tenants already waiting (router/flow_control/gate.py), so that idling
earns no credit and a past flood is not a debt forever.

These are one router's; `SharedServiceCounters` (router/flow_control/shared.py) keeps
them in the index's Redis for every replica. `RecentDemand`, which tells who has asked
for more than its share lately, is each router's own: a flood that a load balancer
spreads over the replicas is over its share at each; a tenant pinned to one replica is
not known at the others.
"""

from __future__ import annotations

import math
from collections.abc import Collection


class ServiceCounters:
    """Each (model, tenant)'s counter, read and written synchronously by the gate."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, float]] = {}

    def value(self, model: str, tenant: str) -> float:
        return self._values.get(model, {}).get(tenant, 0.0)

    def models(self) -> list[str]:
        return list(self._values)

    def values(self, model: str) -> dict[str, float]:
        """The model's counters (a copy)."""
        return dict(self._values.get(model, {}))

    def charge(self, model: str, tenant: str, amount: float) -> None:
        """`amount` more service (already weighted and divided by the tenant's share)."""
        if amount:
            counters = self._values.setdefault(model, {})
            counters[tenant] = counters.get(tenant, 0.0) + amount

    def clamp(self, model: str, tenant: str, low: float, high: float) -> None:
        """The tenant's counter brought within [low, high]."""
        current = self.value(model, tenant)
        wanted = min(max(current, low), high)
        if wanted != current:
            self._values.setdefault(model, {})[tenant] = wanted


OVER_SHARE_MARGIN = 2.0
"""A tenant asks for more than its share where its recent demand is over the mean of the
other tenants asking lately by this much: tenants with equal demands stay under it
through the noise of their arrivals, and so do tenants that all ask past their shares
(three at 0.8 of the fleet, with shares 2:1:1: the share-1 tenants' demands are 1.33
times the others' mean), where a flood is far over it."""


FORGOTTEN = 0.01  # of the recent demand of all: a tenant with less is not counted


class RecentDemand:
    """Each (model, tenant)'s demand lately: what its requests would cost (their prompt
    tokens at the input cost, their answers as long as its answers lately: router/
    flow_control/gate.py), divided by its share, decayed with a time constant of
    `window_s`. What tenants ask, not what they are served: the counters give tenants
    that all wait equal service, so a flood that waits is served no more than the
    tenants beside it, and only its demand tells it from them."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._values: dict[str, dict[str, tuple[float, float]]] = {}  # (value, as of)

    def asked(self, model: str, tenant: str, amount: float, now: float) -> None:
        values = self._values.setdefault(model, {})
        values[tenant] = (self._decayed(values.get(tenant), now) + amount, now)

    def asking(self, model: str, now: float) -> set[str]:
        """The tenants that asked for `model` lately (a tenant whose demand has decayed
        to almost nothing no longer does)."""
        recent = self._recent(model, now)
        return _asking(recent, sum(recent.values()))

    def over_share(self, model: str, now: float, waiting: Collection[str]) -> set[str]:
        """The tenants that asked for more than their share of `model` lately, among the
        tenants asking lately and those `waiting` for it."""
        recent = self._recent(model, now)
        total = sum(recent.values())
        asking = _asking(recent, total)
        sharing = asking | set(waiting)
        if len(sharing) < 2:
            return set()  # alone, a tenant's share is all of it
        others = len(sharing) - 1
        return {
            name
            for name in asking
            if recent[name] > OVER_SHARE_MARGIN * (total - recent[name]) / others
        }

    def _recent(self, model: str, now: float) -> dict[str, float]:
        values = self._values.get(model, {})
        return {name: self._decayed(value, now) for name, value in values.items()}

    def _decayed(self, value: tuple[float, float] | None, now: float) -> float:
        if value is None:
            return 0.0
        amount, as_of = value
        return amount * math.exp(-max(0.0, now - as_of) / self._window_s)


def _asking(recent: dict[str, float], total: float) -> set[str]:
    return {name for name, value in recent.items() if value > FORGOTTEN * total}
