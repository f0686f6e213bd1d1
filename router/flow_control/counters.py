"""Virtual token counters: how much service each tenant has had of a model, in tokens
weighted by cost and divided by the tenant's share (VTC, Sheng et al., OSDI'24). The
backlogged tenant with the lowest counter is served next, so over any stretch where
tenants are backlogged their service follows their shares, whatever their requests cost.

Counters only rise, except where a tenant starts waiting: it is brought within the
counters of the tenants already waiting (router/flow_control/gate.py), so that idling
earns no credit and a past flood is not a debt forever.

These are one router's; `SharedServiceCounters` (router/flow_control/shared.py) keeps
them in the index's Redis for every replica.
"""

from __future__ import annotations


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
