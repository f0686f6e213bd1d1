"""Per-tenant request limits: a rate (a token bucket) and a ceiling on requests in
progress. A request past either is refused with 429 before any work is done for it;
the decision reads only the tenant's counters and the injected clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvplane.core.clock import Clock
from kvplane.core.config import RequestLimits
from router.errors import RequestRefused
from router.tenants import Tenant


@dataclass(frozen=True, slots=True)
class LimitReached:
    """Why a request was refused, and when trying again can succeed."""

    reason: str  # a metric label: "rate_limited" or "concurrency_limited"
    retry_after_s: int  # whole seconds, at least 1, as Retry-After carries them
    message: str

    def error(self) -> RequestRefused:
        """The 429 the client gets."""
        return RequestRefused(
            429,
            self.message,
            kind="RateLimitError",
            outcome=self.reason,
            headers={"retry-after": str(self.retry_after_s)},
        )


@dataclass(slots=True)
class _Allowance:
    tokens: float
    updated_at: float
    in_progress: int = 0


def burst_of(limits: RequestLimits) -> float:
    """The bucket's size: the configured burst, else one second of the rate (at least one
    request)."""
    assert limits.requests_per_s is not None
    return float(limits.burst or max(1, math.ceil(limits.requests_per_s)))


class TenantLimiter:
    def __init__(self, clock: Clock, *, busy_retry_after_s: int = 1) -> None:
        self._clock = clock
        self._busy_retry_after_s = max(1, busy_retry_after_s)
        self._allowances: dict[str, _Allowance] = {}

    def admit(self, tenant: Tenant) -> LimitReached | None:
        """None when the request may go on (then `release` it when it ends); else why not.

        A refused request takes nothing from the tenant's allowance."""
        limits = tenant.limits
        if limits.requests_per_s is None and limits.concurrent_requests is None:
            return None
        now = self._clock()
        allowance = self._allowances.get(tenant.name)
        if allowance is None:
            full = burst_of(limits) if limits.requests_per_s is not None else 0.0
            allowance = self._allowances[tenant.name] = _Allowance(full, now)
        if (
            limits.concurrent_requests is not None
            and allowance.in_progress >= limits.concurrent_requests
        ):
            return LimitReached(
                "concurrency_limited",
                self._busy_retry_after_s,
                f"tenant {tenant.name!r} has {limits.concurrent_requests} requests in "
                "progress, its limit",
            )
        if limits.requests_per_s is not None:
            rate = limits.requests_per_s
            allowance.tokens = min(
                burst_of(limits), allowance.tokens + (now - allowance.updated_at) * rate
            )
            allowance.updated_at = now
            if allowance.tokens < 1:
                wait_s = (1 - allowance.tokens) / rate
                return LimitReached(
                    "rate_limited",
                    max(1, math.ceil(wait_s)),
                    f"tenant {tenant.name!r} is over its limit of {rate:g} requests a second",
                )
            allowance.tokens -= 1
        allowance.in_progress += 1
        return None

    def release(self, tenant: Tenant) -> None:
        """A request `admit` let through has ended (its stream included)."""
        allowance = self._allowances.get(tenant.name)
        if allowance is not None and allowance.in_progress > 0:
            allowance.in_progress -= 1

    def in_progress(self, tenant: Tenant) -> int:
        allowance = self._allowances.get(tenant.name)
        return 0 if allowance is None else allowance.in_progress
