"""The router's upkeep loops, each a background task for the router's lifetime: purging
expired workers from the index, and following the tenants' scope generations in it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvplane.core.clock import Clock
from router.control_plane.workers import WorkerView
from router.index.base import LocationIndex, LocationIndexError
from router.tenants import TenantDirectory

log = logging.getLogger(__name__)

SCOPE_REFRESH_S = 1.0
SPARING_LEASES = 3
"""How long, in leases, the reaper spares leases that ran out during an index outage
once it answers again: an agent's reconnects back off up to a lease
(agent.reconnect_max_s), and a fleet's registrations after an outage queue."""


async def follow_scope_generations(index: LocationIndex, tenants: TenantDirectory) -> None:
    """Keep the tenants' salts on the scope generations in the index: a purge through
    another router replica takes effect here within SCOPE_REFRESH_S."""
    while True:
        try:
            tenants.apply_generations(await index.scope_generations())
        except LocationIndexError as error:  # the index is down: keep the salts we have
            log.debug("reading scope generations failed (%s)", type(error).__name__)
        except Exception:  # a task's edge: a bug raised further is never seen, so log it
            log.exception("reading scope generations failed")
        await asyncio.sleep(SCOPE_REFRESH_S)


async def reap_forever(
    index: LocationIndex,
    view: WorkerView,
    lease_s: float,
    clock: Clock,
    after_sweep: Callable[[], None] = lambda: None,
) -> None:
    """Purge expired workers about four times per lease, so a dead worker's entries
    outlive its lease by a quarter of one at most; then `after_sweep()`."""
    reaper = Reaper(index, view, lease_s, clock)
    while True:
        await asyncio.sleep(lease_s / 4)
        try:
            await reaper.reap_once()
            after_sweep()
        except Exception:  # a task's edge: a bug raised further is never seen, so log it
            log.exception("reaping expired workers failed")


class Reaper:
    """Purges expired workers, sparing those whose leases ran out while the index could
    not be reached: no agent could renew through it then (a Redis failover takes longer
    than a lease), and a worker spared until its agent reconnects resumes with its
    entries (the index keeps an incarnation until it is purged) instead of sending its
    whole cache again. They are spared for SPARING_LEASES leases after the index answers
    again; lookups skip them meanwhile, as they skip every worker whose lease ran out."""

    def __init__(self, index: LocationIndex, view: WorkerView, lease_s: float, clock: Clock):
        self.index, self.view, self.lease_s, self.clock = index, view, lease_s, clock
        self._outage_since: float | None = None  # before the first purge that failed
        self._sparing_until: float | None = None  # once the index answered again

    def grace_s(self, now: float) -> float:
        """How long ago a lease must have run out to be purged now."""
        if self._outage_since is None:
            return 0.0
        if self._sparing_until is None:  # the first round since the outage
            self._sparing_until = now + SPARING_LEASES * self.lease_s
        elif now >= self._sparing_until:
            self._outage_since = self._sparing_until = None
            return 0.0
        return now - self._outage_since

    async def reap_once(self) -> None:
        now = self.clock()
        try:
            purged = await self.index.purge_expired(self.grace_s(now))
        except LocationIndexError as error:  # the reaper outlives index outages
            # No sweep either: while the index is down no agent can renew its lease, and
            # expiring them all here would stop routing to a healthy fleet. A worker
            # that really died meanwhile costs a failover, not a failed request.
            log.warning("purging expired workers failed (%s)", type(error).__name__)
            if self._outage_since is None:  # it may have begun since the last round
                self._outage_since = now - self.lease_s / 4
            self._sparing_until = None
            return
        self.view.sweep(purged, self.clock(), self.lease_s)
        if purged:
            log.info("purged %d expired workers: %s", len(purged), ", ".join(purged))
