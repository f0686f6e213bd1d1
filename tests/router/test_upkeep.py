"""The reaper (router/upkeep.py): expired workers purged, and leases that ran out while
the index could not be reached spared until their agents can come back."""

from __future__ import annotations

from collections.abc import Sequence

from router.control_plane.workers import WorkerView
from router.index.base import IndexUnavailable
from router.index.memory import MemoryLocationIndex
from router.upkeep import SPARING_LEASES, Reaper
from tests.clock import ManualClock
from tests.router.index.test_conformance import chain, info, stored

LEASE = 4.0


class IndexThatGoesDown(MemoryLocationIndex):
    """The in-memory index, whose purges fail while `down` (an outage as the reaper
    sees one: the call raises IndexUnavailable)."""

    down = False

    async def purge_expired(self, grace_s: float = 0.0) -> list[str]:
        if self.down:
            raise IndexUnavailable("the test took the index down")
        return await super().purge_expired(grace_s)


async def _registered(index: IndexThatGoesDown) -> Sequence[str]:
    return sorted(status.info.worker_id for status in await index.workers())


async def test_leases_that_ran_out_during_an_outage_are_spared_for_a_while() -> None:
    clock = ManualClock()
    index = IndexThatGoesDown(clock=clock)
    reaper = Reaper(index, WorkerView(), LEASE, clock)
    await index.register(info("before"), LEASE / 2)  # dies before the outage
    await index.register(info("returns"), LEASE)
    await index.register(info("gone"), LEASE)
    await index.apply("returns", 1, [stored(chain(90, 3))], sequence=1)

    clock.advance(LEASE * 3 / 4)  # "before" has run out
    index.down = True
    for _ in range(6):  # a lease and a half of failed rounds: every lease runs out
        await reaper.reap_once()
        clock.advance(LEASE / 4)
    index.down = False

    await reaper.reap_once()  # the index answers: only what died before the outage goes
    assert await _registered(index) == ["gone", "returns"]
    clock.advance(LEASE / 2)
    assert await index.register(info("returns"), LEASE) == 1  # resumes, entries whole
    assert (await index.lookup(chain(90, 3)))["returns"].blocks == 3
    await reaper.reap_once()
    assert await _registered(index) == ["gone", "returns"]

    for _ in range(2 * SPARING_LEASES - 1):  # rounds until sparing ends
        clock.advance(LEASE / 2)
        await index.renew("returns", 1, LEASE)  # its agent renews, as it does
        await reaper.reap_once()
    assert await _registered(index) == ["returns"]
