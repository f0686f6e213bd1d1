"""Pure: where a request waits. Its band is its tenant's priority, or what its
`x-kvplane-priority` header asks, capped at the tenant's maximum; the header of a tenant
that may not set one is ignored (its value never reaches an engine). Its deadline is its
`x-kvplane-ttft-deadline-ms`, from its arrival."""

from __future__ import annotations

from dataclasses import dataclass

from router.errors import RequestRefused
from router.tenants import Tenant

PRIORITY_HEADER = "x-kvplane-priority"
DEADLINE_HEADER = "x-kvplane-ttft-deadline-ms"
_BAND_LIMIT = 1000  # as TenantSpec.priority's bounds
_LONGEST_DEADLINE_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class Placement:
    """A request's band (higher first; below 0, shed first) and deadline (seconds from
    its arrival to its first byte; None: none)."""

    band: int
    deadline_s: float | None = None


def placement(tenant: Tenant, priority: str | None, deadline_ms: str | None) -> Placement:
    """The request's placement from its tenant and its two headers (None: absent); a
    header that is not a whole number in range is a 400."""
    band = tenant.priority
    if priority is not None and tenant.max_priority is not None:
        band = min(
            _whole(PRIORITY_HEADER, priority, -_BAND_LIMIT, _BAND_LIMIT), tenant.max_priority
        )
    deadline_s = None
    if deadline_ms is not None:
        deadline_s = _whole(DEADLINE_HEADER, deadline_ms, 1, _LONGEST_DEADLINE_MS) / 1000
    return Placement(band, deadline_s)


def engine_priority(band: int, backlogged: bool) -> int:
    """vLLM's `priority` (lower first) for a request of `band`: bands strictly apart,
    and within one a tenant with a backlog after those without (its flood does not
    push ahead of a lighter tenant's request in the engine's queue)."""
    return -2 * band + int(backlogged)


def _whole(header: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise RequestRefused(
            400,
            f"{header} must be a whole number from {low} to {high}",
            kind="BadRequestError",
            outcome="bad_header",
        )
    return number
