"""One simulated engine replica, driven in simulated time: the engine simulator's block
pool, cache manager, scheduler and timing model, unchanged, and optionally its CPU tier
(offload.py's CPUTier and OffloadingConnector, as the scheduler's KV loader), whose
copies offload_copies.py starts and ends as for the engine simulator: the simulator
waits them out on its clock (`take_copies`, `copy_done`).

Token by token a long trace would take hours of Python, so a run of decode steps in
which nothing can change (nobody waiting, nobody needing a new block, nobody finishing,
no arrival due, no copy to or from the CPU tier in flight or still to offer) is taken
as one macro step: its duration is the sum of the timing model's step durations, its
effect k tokens for every running request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulations.engine_sim.block_pool import BlockPool, BlockRemoved, BlocksStored, CacheEvent
from simulations.engine_sim.kv_cache_manager import KVCacheManager
from simulations.engine_sim.offload import (
    BlocksOffloaded,
    CPUTier,
    OffloadedBlocksRemoved,
    OffloadEvent,
    OffloadingConnector,
)
from simulations.engine_sim.offload_copies import OffloadCopies, TierCopy, counted_loads
from simulations.engine_sim.request import RequestStatus
from simulations.engine_sim.scheduler import (
    RequestProgress,
    ScheduledStep,
    Scheduler,
    SchedulerLimits,
)
from simulations.engine_sim.timing import StepWork, TimingModel, step_seconds
from simulations.fleet_sim.requests import TraceRequest

_UNBOUNDED_STEPS = 1 << 30


def block_digest(block_id: int) -> bytes:
    return block_id.to_bytes(16, "little", signed=True)


def block_id(digest: bytes) -> int:
    return int.from_bytes(digest, "little", signed=True)


class FleetRequest:
    """A trace request as the engine's scheduler sees it: prompt blocks by id, output
    counted but never materialised."""

    __slots__ = (
        "_digests",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_count",
        "request_id",
        "status",
        "trace",
        "worker",
    )

    def __init__(self, trace: TraceRequest, block_tokens: int, worker: int) -> None:
        self.trace = trace
        self.worker = worker
        self.request_id = str(trace.request_id)
        self.max_tokens = max(1, trace.output_tokens)
        self.output_count = 0
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # Only full prompt blocks can be cached (the last one is usually partial).
        full = trace.prompt_tokens // block_tokens
        self._digests = [block_digest(block) for block in trace.blocks[:full]]

    @property
    def num_prompt_tokens(self) -> int:
        return self.trace.prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.trace.prompt_tokens + self.output_count

    @property
    def block_digests(self) -> Sequence[bytes]:
        return self._digests

    @property
    def lora_name(self) -> str | None:
        return None

    @property
    def scope(self) -> str:
        return self.trace.tenant

    @property
    def is_finished(self) -> bool:
        return self.output_count >= self.max_tokens

    def token_ids_between(self, start: int, stop: int) -> Sequence[int]:
        return ()

    def block_extra_keys(self, index: int) -> tuple[str, ...] | None:
        return None

    def append_output(self, token_id: int) -> None:
        self.output_count += 1


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    waiting: int
    running: int
    kv_usage: float


@dataclass(frozen=True, slots=True)
class CpuTierShape:
    """A worker's CPU tier: its blocks and its copies' cost (the engine simulator's
    `--cpu-offload-blocks`, `--kv-offload-bytes-per-s`, `--kv-bytes-per-token`)."""

    blocks: int
    bytes_per_s: float
    kv_bytes_per_token: int


@dataclass(slots=True)
class _MacroStep:
    steps: int
    requests: list[FleetRequest]


class SimWorker:
    def __init__(
        self,
        index: int,
        *,
        capacity_tokens: int,
        block_tokens: int,
        timing: TimingModel,
        limits: SchedulerLimits,
        macro_steps: bool = True,
        cpu_tier: CpuTierShape | None = None,
    ) -> None:
        self.index = index
        self.macro_steps = macro_steps  # off: every step one at a time (tests compare)
        self.timing = timing
        self.pool = BlockPool(max(1, capacity_tokens // block_tokens))
        self.kv_cache = KVCacheManager(self.pool, block_tokens)
        self.scheduler: Scheduler[FleetRequest]
        self.copies: OffloadCopies[FleetRequest] | None = None
        if cpu_tier is None:
            self.scheduler = Scheduler(self.kv_cache, limits, _no_token)
        else:
            # The fleet's requests cache prompt blocks only, so the tier gets those alone
            # either way; the prefix cache is always on.
            connector = OffloadingConnector(
                CPUTier(cpu_tier.blocks), block_tokens, prompt_only=True, prefix_caching=True
            )
            self.scheduler = Scheduler(self.kv_cache, limits, _no_token, connector)
            self.copies = OffloadCopies(
                connector,
                self.scheduler,
                kv_bytes_per_token=cpu_tier.kv_bytes_per_token,
                bytes_per_s=cpu_tier.bytes_per_s,
            )
        self.busy = False
        self._step: ScheduledStep[FleetRequest] | _MacroStep | None = None
        self.computed_tokens = 0  # prefill and decode tokens computed: the worker's work
        # The CPU tier's copies: started and not yet handed to the simulator, the step's
        # writes (started when it ends), how many are in flight, and whether the last
        # step's offers found no room (then offered again next step).
        self._started: list[TierCopy[FleetRequest]] = []
        self._writes: list[TierCopy[FleetRequest]] = []
        self._copies_in_flight = 0
        self._offers_refused = False
        # Tokens read back from the CPU tier, as vLLM's external_prefix_cache_hits counts
        # them.
        self.external_hits = 0

    def add(self, request: FleetRequest) -> None:
        self.scheduler.add(request)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            waiting=self.scheduler.num_waiting,
            running=len(self.scheduler.running),
            kv_usage=self.pool.usage,
        )

    def start_step(self, now: float, horizon: float) -> float | None:
        """Begin the next step; its end time, or None when there is nothing to do.
        A macro step does not run past `horizon` (the next arrival anywhere)."""
        macro = self._macro_step(horizon - now) if self.macro_steps else None
        if macro is not None:
            self._step = macro
            duration = _decode_seconds(self.timing, macro.requests, macro.steps)
        else:
            step = self.scheduler.schedule()
            self._start_copies(step)
            if step.is_empty:
                self._step, self.busy = None, False
                return None
            self._step = step
            duration = step_seconds(self.timing, step.work)
        self.busy = True
        return now + duration

    def finish_step(self) -> list[RequestProgress[FleetRequest]]:
        step, self._step = self._step, None
        if isinstance(step, _MacroStep):
            progress = self._finish_macro(step)
        else:
            assert step is not None
            self.computed_tokens += sum(step.tokens.values())
            progress = self.scheduler.finish_step(step)
        if self.copies is not None:
            for done in progress:
                if done.finished:
                    self.copies.ended(done.request)
        self._started += self._writes
        self._writes = []
        return progress

    def take_copies(self) -> list[TierCopy[FleetRequest]]:
        """The copies started since the last call (now): their ends are the caller's to
        time, and to report with `copy_done`."""
        started, self._started = self._started, []
        self._copies_in_flight += len(started)
        return started

    def copy_done(self, copy: TierCopy[FleetRequest]) -> None:
        assert self.copies is not None
        self._copies_in_flight -= 1
        self.copies.done(copy)

    def take_cache_events(self) -> list[CacheEvent | OffloadEvent]:
        """The device's events, then the CPU tier's (as vLLM adds its connector's)."""
        events: list[CacheEvent | OffloadEvent] = [*self.pool.take_events()]
        if self.copies is not None:
            events += self.copies.connector.tier.take_events()
        return events

    def _start_copies(self, step: ScheduledStep[FleetRequest]) -> None:
        """The step's reads start now; its writes when it ends."""
        if self.copies is None:
            return
        self.external_hits += sum(
            tokens for _, tokens in counted_loads(step, self.kv_cache.block_size)
        )
        self._started += self.copies.reads(step)
        self._writes, refused = self.copies.writes(step)
        self._offers_refused = bool(refused)

    def _macro_step(self, seconds_left: float) -> _MacroStep | None:
        scheduler = self.scheduler
        running = scheduler.running
        if scheduler.num_waiting or not running:
            return None
        if self._copies_in_flight or self._offers_refused:
            return None
        steps = None
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1 or (
                request.num_computed_tokens < request.num_prompt_tokens
            ):
                return None  # still reading its prompt
            room = self.kv_cache.held_tokens(request) - request.num_computed_tokens
            left = request.max_tokens - request.output_count
            fit = min(room, left)
            steps = fit if steps is None else min(steps, fit)
        assert steps is not None
        steps = min(steps, _steps_within(self.timing, running, seconds_left))
        if steps < 2:
            return None
        return _MacroStep(steps, list(running))

    def _finish_macro(self, macro: _MacroStep) -> list[RequestProgress[FleetRequest]]:
        progress = []
        scheduler = self.scheduler
        for request in macro.requests:
            request.num_computed_tokens += macro.steps
            request.output_count += macro.steps
            finished = request.is_finished
            if finished:
                scheduler.running.remove(request)
                self.kv_cache.free(request)
                request.status = RequestStatus.FINISHED
            progress.append(RequestProgress(request, 0, finished))
        self.computed_tokens += macro.steps * len(macro.requests)
        return progress


def _no_token(request: FleetRequest) -> int:
    return 0


def _decode_seconds(timing: TimingModel, running: Sequence[FleetRequest], steps: int) -> float:
    """The timing model's duration of `steps` decode steps of `running`: each step
    attends over one more token per request than the one before."""
    context = sum(request.num_tokens for request in running)
    batch = len(running)
    per_step = step_seconds(timing, StepWork(0, batch, context))
    growth = step_seconds(timing, StepWork(0, batch, context + batch)) - per_step
    return steps * per_step + growth * steps * (steps - 1) / 2


def _steps_within(timing: TimingModel, running: Sequence[FleetRequest], seconds: float) -> int:
    """How many decode steps end within `seconds` (at least one)."""
    first = _decode_seconds(timing, running, 1)
    if first <= 0 or math.isinf(seconds):
        return _UNBOUNDED_STEPS
    low, high = 1, max(1, int(seconds / first) + 1)
    while low < high:  # the largest count that fits, by bisection
        middle = (low + high + 1) // 2
        if _decode_seconds(timing, running, middle) <= seconds:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(slots=True)
class CacheNews:
    """A batch of a worker's events in block ids: the device's, and its CPU tier's."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    host_stored: list[int] = field(default_factory=list)
    host_removed: list[int] = field(default_factory=list)


def cache_news(events: Sequence[CacheEvent | OffloadEvent]) -> CacheNews:
    news = CacheNews()
    for event in events:
        if isinstance(event, BlocksStored):
            news.stored.extend(block_id(digest) for digest in event.digests)
        elif isinstance(event, BlockRemoved):
            news.removed.append(block_id(event.digest))
        elif isinstance(event, BlocksOffloaded):
            news.host_stored.extend(block_id(digest) for digest in event.digests)
        elif isinstance(event, OffloadedBlocksRemoved):
            news.host_removed.extend(block_id(digest) for digest in event.digests)
        else:
            news.cleared = True
    return news
