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
    while True:
        await asyncio.sleep(lease_s / 4)
        try:
            await reap_once(index, view, lease_s, clock)
            after_sweep()
        except Exception:  # a task's edge: a bug raised further is never seen, so log it
            log.exception("reaping expired workers failed")


async def reap_once(index: LocationIndex, view: WorkerView, lease_s: float, clock: Clock) -> None:
    try:
        purged = await index.purge_expired()
    except LocationIndexError as error:  # the reaper outlives index outages and tries again
        # No sweep either: while the index is down no agent can renew its lease, and
        # expiring them all here would stop routing to a healthy fleet. A worker that
        # really died meanwhile costs a failover, not a failed request.
        log.warning("purging expired workers failed (%s)", type(error).__name__)
        return
    view.sweep(purged, clock(), lease_s)
    if purged:
        log.info("purged %d expired workers: %s", len(purged), ", ".join(purged))
