"""What a simulated router knows, and when: the blocks each worker's events reported, on
its device and on its CPU tier (delivered `event_delay_s` after the engine step that
produced them), each worker's
last load report (taken every `load_interval_s`, delivered `load_delay_s` later), and
its own traffic (requests sent, before their first token, finished), which it knows at
once. Policies decide from this view only, never from the workers themselves.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from kvplane.core.types import Tier
from simulations.fleet_sim.worker import WorkerLoad


def leading_matches(held: Container[int], blocks: Sequence[int]) -> int:
    """How many of `blocks`, from the first, are all in `held`."""
    matched = 0
    for block in blocks:
        if block not in held:
            break
        matched += 1
    return matched


@dataclass(slots=True)
class WorkerTraffic:
    in_flight: int = 0
    prefilling: dict[int, tuple[float, int]] = field(default_factory=dict)  # id: (sent, tokens)
    prefill_tokens: int = 0


@dataclass(slots=True)
class LoadReport:
    load: WorkerLoad
    taken_at: float


class RouterView:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.cached: list[set[int]] = [set() for _ in range(workers)]  # on the device
        self.host_cached: list[set[int]] = [set() for _ in range(workers)]  # on the CPU tier
        self.reports: list[LoadReport | None] = [None] * workers
        self.traffic = [WorkerTraffic() for _ in range(workers)]

    def matched_blocks(self, worker: int, blocks: Sequence[int]) -> int:
        """The request's longest prefix the worker's events reported as cached on its
        device (what the peers' policies read)."""
        return leading_matches(self.cached[worker], blocks)

    def matched_by_tier(self, worker: int, blocks: Sequence[int]) -> tuple[int, int]:
        """The request's longest prefix the worker holds on either tier, as the router's
        index matches it: its blocks on the device, and those on the CPU tier only (a
        block on both counts once, on the device)."""
        device, host = self.cached[worker], self.host_cached[worker]
        on_device = on_host = 0
        for block in blocks:
            if block in device:
                on_device += 1
            elif block in host:
                on_host += 1
            else:
                break
        return on_device, on_host

    # -- deliveries ----------------------------------------------------------------

    def events(
        self,
        worker: int,
        stored: Sequence[int],
        removed: Sequence[int],
        cleared: bool,
        *,
        tier: Tier = Tier.DEVICE,
    ) -> None:
        cached = (self.cached if tier is Tier.DEVICE else self.host_cached)[worker]
        if cleared:
            cached.clear()
        cached.difference_update(removed)
        cached.update(stored)

    def report(self, worker: int, report: LoadReport) -> None:
        self.reports[worker] = report

    # -- this router's own traffic ---------------------------------------------------

    def sent(self, worker: int, request_id: int, now: float, uncached_tokens: int) -> None:
        traffic = self.traffic[worker]
        traffic.in_flight += 1
        traffic.prefilling[request_id] = (now, uncached_tokens)
        traffic.prefill_tokens += uncached_tokens

    def first_token(self, worker: int, request_id: int) -> None:
        traffic = self.traffic[worker]
        entry = traffic.prefilling.pop(request_id, None)
        if entry is not None:
            traffic.prefill_tokens -= entry[1]

    def finished(self, worker: int, request_id: int) -> None:
        self.first_token(worker, request_id)
        self.traffic[worker].in_flight -= 1
