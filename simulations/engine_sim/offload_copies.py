"""The CPU tier's copies as an engine loop drives them: which copies a step starts, how
long each lasts, and what its end does. Shared by the engine simulator (engine.py, which
waits the copies out in real time) and the fleet simulator (fleet_sim/worker.py, in
simulated time), so that both run the tier by the same rules.

As vLLM's engine does: a request whose load the scheduler admitted reads its blocks
before it computes; each request's blocks that a step computes are offered to the tier
(offload.py decides which it writes) as one write, started once the step has computed
them (vLLM starts them with the next step). A copy lasts its bytes over the copy
bandwidth, times the time scale. A read's end hands the request back to the scheduler;
a write's makes its blocks readable, and announced in the next batch of events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from simulations.engine_sim.metrics import LOAD, STORE
from simulations.engine_sim.offload import OffloadingConnector
from simulations.engine_sim.scheduler import ScheduledRequest, ScheduledStep, Scheduler

R = TypeVar("R", bound=ScheduledRequest)


@dataclass(frozen=True, slots=True)
class TierCopy(Generic[R]):
    """One copy between the device and the CPU tier: a request's read, or its writes of
    one step."""

    request: R
    transfer_type: str  # LOAD (a read) or STORE (a write), as vLLM's metrics name them
    digests: list[bytes]
    num_bytes: int
    seconds: float


class OffloadCopies(Generic[R]):
    def __init__(
        self,
        connector: OffloadingConnector,
        scheduler: Scheduler[R],
        *,
        kv_bytes_per_token: int,
        bytes_per_s: float,
        time_scale: float = 1.0,
    ) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self._block_bytes = connector.block_size * kv_bytes_per_token
        self._bytes_per_s = bytes_per_s
        self._time_scale = time_scale

    def reads(self, step: ScheduledStep[R]) -> list[TierCopy[R]]:
        """The reads the step starts: one for each load it admitted."""
        return [
            self._copy(request, LOAD, self.connector.loading(request)) for request in step.kv_loads
        ]

    def writes(self, step: ScheduledStep[R]) -> tuple[list[TierCopy[R]], list[R]]:
        """The step's writes, to start when it ends: each scheduled request's blocks
        computed by the step's end that the tier lacks (room made for them now); and the
        requests whose blocks found no room (vLLM's allocation failure: they offer them
        again next step)."""
        writes: list[TierCopy[R]] = []
        refused: list[R] = []
        for request, count in step.tokens.items():
            blocks = self.scheduler.kv_cache.blocks_of(request)
            digests = self.connector.store(request, request.num_computed_tokens + count, blocks)
            if digests is None:
                refused.append(request)
            elif digests:
                writes.append(self._copy(request, STORE, digests))
        return writes, refused

    def done(self, copy: TierCopy[R]) -> None:
        """The copy completed. A read's request waits to be scheduled, before the waiting
        queue; a write's blocks are readable, and announced with the next events."""
        if copy.transfer_type == LOAD:
            self.connector.load_finished(copy.digests)
            self.scheduler.finish_load(copy.request)
        else:
            self.connector.store_finished(copy.request.request_id, copy.digests)

    def ended(self, request: R) -> None:
        """The request finished or was aborted: what it used becomes the most recent."""
        self.connector.request_finished(request)

    def _copy(self, request: R, transfer_type: str, digests: Sequence[bytes]) -> TierCopy[R]:
        num_bytes = len(digests) * self._block_bytes
        seconds = num_bytes / self._bytes_per_s * self._time_scale
        return TierCopy(request, transfer_type, list(digests), num_bytes, seconds)


def counted_loads(step: ScheduledStep[R], block_size: int) -> list[tuple[R, int]]:
    """The KV loads the step admitted that vLLM counts as external prefix-cache hits (a
    connector's: the CPU tier's reads, a decode leg's pull), in tokens per request: not
    one after a preemption, as vLLM counts preempted requests apart."""
    return [
        (request, num_blocks * block_size)
        for request, num_blocks in step.kv_loads.items()
        if num_blocks and not request.num_preemptions
    ]
