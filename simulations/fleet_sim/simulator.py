"""The discrete-event loop: arrivals, engine steps, event and load-report deliveries.

Deterministic for a seed: one event heap ordered by (time, sequence number), policies
drawing from their own seeded generator. Simulated time is free: a run costs what its
events cost, not what they model.

Router overhead (`FleetConfig.router_overhead_s`, per policy name): what the router
costs a request before the engine has it (parsing, routing, forwarding). A request
sent at t reaches the router at t, is routed and reaches its worker at t + overhead;
its TTFT and end-to-end latency count from t. Off (0) unless given.

Closed loop: a request that follows another (`TraceRequest.follows`) is sent
`after_s` after that request finishes; one whose parent was refused is never sent.
Macro steps are off for such workloads (an arrival can then be created while another
worker's macro step runs, which would then overshoot it).

CPU tier (`FleetConfig.cpu_offload_blocks`, per worker; 0: none): the engine
simulator's, driven as its engine drives it (worker.py). Each copy ends its bytes over
`kv_offload_bytes_per_s` after it starts (a read when the scheduler admits its load,
before the request computes; a step's writes when the step ends); the tier's stores and
removals reach the router `event_delay_s` after the batch they go out in, as the
device's do: at the end of the worker's step, or at once if it is idle (the engine
publishes while its copies are in flight).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.core.types import Tier
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.scheduler import RequestTooLarge, SchedulerLimits
from simulations.engine_sim.timing import TimingModel
from simulations.fleet_sim.policies import Policy
from simulations.fleet_sim.requests import TraceRequest, Workload
from simulations.fleet_sim.router_view import LoadReport, RouterView
from simulations.fleet_sim.worker import CpuTierShape, FleetRequest, SimWorker, cache_news

_ENGINE_DEFAULTS = EngineSimConfig.model_fields


@dataclass(frozen=True, slots=True)
class FleetConfig:
    workers: int = 10
    capacity_tokens: int = 3_000_000  # KV cache per worker
    timing: TimingModel = field(default_factory=TimingModel)
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    event_delay_s: float = 0.01  # engine step to the router's index
    load_interval_s: float = 1.0
    load_delay_s: float = 0.01
    macro_steps: bool = True  # runs of unchanging decode steps as one event
    # Per policy name: seconds from a request's sending to its worker having it.
    router_overhead_s: dict[str, float] = field(default_factory=dict)
    # A CPU tier of this many blocks per worker (0: none); its copies' bandwidth and the
    # bytes of a token's KV, the engine simulator's defaults.
    cpu_offload_blocks: int = 0
    kv_offload_bytes_per_s: float = _ENGINE_DEFAULTS["kv_offload_bytes_per_s"].default
    kv_bytes_per_token: int = _ENGINE_DEFAULTS["kv_bytes_per_token"].default

    def __post_init__(self) -> None:
        if self.cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks cannot be negative")
        if not self.kv_offload_bytes_per_s > 0 or self.kv_bytes_per_token < 1:
            raise ValueError("kv_offload_bytes_per_s and kv_bytes_per_token must be positive")

    @property
    def cpu_tier(self) -> CpuTierShape | None:
        if not self.cpu_offload_blocks:
            return None
        return CpuTierShape(
            self.cpu_offload_blocks, self.kv_offload_bytes_per_s, self.kv_bytes_per_token
        )


@dataclass(slots=True)
class RequestOutcome:
    worker: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    rejected: bool = False
    request_id: int = -1  # the workload's


@dataclass(slots=True)
class RunRecord:
    policy: str
    outcomes: list[RequestOutcome] = field(default_factory=list)
    worker_work: list[int] = field(default_factory=list)  # tokens computed per worker
    # (time, worker, running + waiting), sampled at every load report
    load_samples: list[tuple[float, int, int]] = field(default_factory=list)
    preemptions: int = 0
    end_s: float = 0.0
    # The engines' prefix-cache counters summed over the workers (vLLM's
    # prefix_cache_queries and _hits, in tokens): every lookup counts, including a
    # waiting request's retries while its blocks do not fit and a preempted one's.
    cache_queries: int = 0
    cache_hits: int = 0
    # Tokens read back from the CPU tiers (vLLM's external_prefix_cache_hits).
    external_hits: int = 0


_ARRIVAL, _STEP_DONE, _EVENTS, _LOAD_TAKEN, _LOAD_DELIVERED, _COPY_DONE = range(6)


def simulate(
    workload: Workload,
    policy: Policy,
    config: FleetConfig,
    progress: Callable[[int], None] | None = None,
) -> RunRecord:
    """Replay the workload through `policy` on a fleet of simulated workers."""
    requests = workload.requests
    scheduled = [r for r in requests if r.follows is None]  # sent on the workload's clock
    followers: dict[int, list[TraceRequest]] = {}
    for r in requests:
        if r.follows is not None:
            followers.setdefault(r.follows, []).append(r)
    overhead = config.router_overhead_s.get(policy.name, 0.0)
    if overhead < 0:
        raise ValueError("a router overhead cannot be negative")
    workers = [
        SimWorker(
            w,
            capacity_tokens=config.capacity_tokens,
            block_tokens=workload.block_tokens,
            timing=config.timing,
            limits=config.limits,
            macro_steps=config.macro_steps and not followers,
            cpu_tier=config.cpu_tier,
        )
        for w in range(config.workers)
    ]
    view = RouterView(config.workers)
    record = RunRecord(policy.name)
    # (time, sequence, kind, worker, what was delivered): ties in time keep their order.
    heap: list[tuple[float, int, int, int, Any]] = []
    sequence = 0
    in_flight: dict[int, RequestOutcome] = {}  # by id() of the FleetRequest

    def push(time: float, kind: int, worker: int = -1, payload: Any = None) -> None:
        nonlocal sequence
        heapq.heappush(heap, (time, sequence, kind, worker, payload))
        sequence += 1

    # An arrival event is a request reaching its worker (router overhead past its
    # sending); its payload: (the request, when it was sent, whether it is scheduled).
    next_arrival = 0  # into `scheduled`
    if scheduled:
        first = scheduled[0]
        push(first.arrival_s + overhead, _ARRIVAL, -1, (first, first.arrival_s, True))
    pending: list[float] = []  # heap: when released followers reach their worker
    for w in range(config.workers):
        push(config.load_interval_s, _LOAD_TAKEN, w)
    unfinished = len(requests)

    def horizon() -> float:
        """The next time any request reaches a worker (as far as is known now)."""
        upcoming = math.inf
        if next_arrival < len(scheduled):
            upcoming = scheduled[next_arrival].arrival_s + overhead
        return min(upcoming, pending[0]) if pending else upcoming

    def never_sent(request_id: int) -> int:
        """How many requests wait, directly or not, on this one's response."""
        return sum(1 + never_sent(child.request_id) for child in followers.get(request_id, ()))

    def publish(worker: SimWorker, now: float) -> None:
        events = worker.take_cache_events()
        if events:
            push(now + config.event_delay_s, _EVENTS, worker.index, events)

    def run_worker(worker: SimWorker, now: float) -> None:
        if not worker.busy:
            end = worker.start_step(now, horizon())
            if end is not None:
                push(end, _STEP_DONE, worker.index)
            else:
                publish(worker, now)  # idle: what its copies or loads changed goes out now
        for copy in worker.take_copies():
            push(now + copy.seconds, _COPY_DONE, worker.index, copy)

    while heap and unfinished:
        now, _, kind, w, payload = heapq.heappop(heap)
        if kind == _ARRIVAL:
            trace, sent_s, on_schedule = payload
            if on_schedule:
                next_arrival += 1
                if next_arrival < len(scheduled):
                    upcoming = scheduled[next_arrival]
                    sent = upcoming.arrival_s
                    push(sent + overhead, _ARRIVAL, -1, (upcoming, sent, True))
            else:
                heapq.heappop(pending)  # the earliest pending one: this one
            chosen = policy.choose(trace, view, now)
            outcome = RequestOutcome(
                chosen,
                sent_s,
                trace.prompt_tokens,
                trace.output_tokens,
                request_id=trace.request_id,
            )
            record.outcomes.append(outcome)
            request = FleetRequest(trace, workload.block_tokens, chosen)
            try:
                workers[chosen].add(request)
            except RequestTooLarge:
                outcome.rejected = True
                unfinished -= 1 + never_sent(trace.request_id)
                continue
            known = sum(view.matched_by_tier(chosen, trace.blocks)) * workload.block_tokens
            view.sent(chosen, trace.request_id, now, max(0, trace.prompt_tokens - known))
            in_flight[id(request)] = outcome
            run_worker(workers[chosen], now)
        elif kind == _STEP_DONE:
            worker = workers[w]
            for progressed in worker.finish_step():
                request = progressed.request
                outcome = in_flight[id(request)]
                if outcome.first_token_s is None:
                    outcome.first_token_s = now
                    outcome.cached_tokens = request.num_cached_tokens or 0
                    view.first_token(worker.index, request.trace.request_id)
                if progressed.finished:
                    outcome.finished_s = now
                    view.finished(worker.index, request.trace.request_id)
                    del in_flight[id(request)]
                    unfinished -= 1
                    for child in followers.get(request.trace.request_id, ()):
                        sent = now + child.after_s
                        push(sent + overhead, _ARRIVAL, -1, (child, sent, False))
                        heapq.heappush(pending, sent + overhead)
                    if progress is not None:
                        progress(len(requests) - unfinished)
            publish(worker, now)
            worker.busy = False
            run_worker(worker, now)
        elif kind == _COPY_DONE:
            workers[w].copy_done(payload)
            run_worker(workers[w], now)
        elif kind == _EVENTS:
            news = cache_news(payload)
            view.events(w, news.stored, news.removed, news.cleared)
            policy.events(w, news.removed, news.cleared, now)
            if news.host_stored or news.host_removed:
                view.events(w, news.host_stored, news.host_removed, False, tier=Tier.HOST)
                policy.events(w, news.host_removed, False, now, tier=Tier.HOST)
        elif kind == _LOAD_TAKEN:
            load = workers[w].load()
            record.load_samples.append((now, w, load.running + load.waiting))
            push(now + config.load_delay_s, _LOAD_DELIVERED, w, LoadReport(load, now))
            push(now + config.load_interval_s, _LOAD_TAKEN, w)
        else:
            view.report(w, payload)
        record.end_s = now
    record.worker_work = [worker.computed_tokens for worker in workers]
    record.preemptions = sum(worker.scheduler.num_preemptions for worker in workers)
    record.cache_queries = sum(worker.kv_cache.stats.queries for worker in workers)
    record.cache_hits = sum(worker.kv_cache.stats.hits for worker in workers)
    record.external_hits = sum(worker.external_hits for worker in workers)
    return record
