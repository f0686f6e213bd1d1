"""`kvplane bench live`: run every cell of the grid, each on a fresh fleet, and gather
its figures.

One cell: start the engines, start the router (kvplane with its agents, or a peer),
read the router's CPU, send the workload, read the CPU again and the engines'
counters, collect the evidence that what was measured was in play, and stop every
process. A cell that fails says why in its result; the others go on.

In front of a fleet that can split requests the evidence says whether P/D was in play
(`pd_in_play`): the engines that take decode legs pulled prompt tokens from others,
and, for kvplane, it split requests (its `kvplane_legs_decided_total{split="true"}`). A
cell where it was not says why (`pd_not_in_play`) and the table says so; for a fleet's
aggregated reference (`kvplane both-never`) it is the other way round: P/D in play there
is what the table flags (`pd_unexpected`).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from benchmarks.live.client import Outcome, Traffic, run_workload
from benchmarks.live.engines import (
    EXTERNAL_KV_TRANSFER,
    FLEET_AGGREGATED,
    LOCAL_CACHE_HIT,
    LOCAL_COMPUTE,
    MODEL,
    EngineShape,
    EngineTotals,
    RunningEngines,
    hit_rate,
    start_engines,
)
from benchmarks.live.fairness import TenantFigures, tenant_figures
from benchmarks.live.grid import BYPASS_SHARE, NOISY_SITUATION, Cell, cell_key
from benchmarks.live.processes import Children, StartFailed
from benchmarks.live.routers import Deployment, api_key
from benchmarks.live.workloads import NOISY_TENANT, NOISY_WORKLOADS, Workload, build_workload
from router.check import BlindFleet
from simulations.reporting import percentile

DRAIN_S = 30.0  # the longest a cell waits for its last responses after the schedule ends
REST_S = 3.0  # the window that times the deployment at rest, before the traffic


@dataclass(slots=True)
class CellResult:
    router: str
    family: str
    policy: str
    workload: str
    load: str
    rate_per_s: float
    situation: str
    run: int
    # `engines.FLEET_*`: "aggregated"; "pd": two prefill and two decode engines;
    # "pd-both": four engines each with NixlConnector, taking either leg
    fleet: str = FLEET_AGGREGATED
    pd_reference: bool = False  # its fleet's aggregated reference: it must split nothing
    version: str = ""
    commands: list[str] = field(default_factory=list)
    workload_description: str = ""
    error: str | None = None  # why the cell has no figures
    requests: int = 0
    failed: int = 0  # not answered, and not shed either
    shed: int = 0  # refused by the router with a 429 (a flow-control shed): no failure
    seconds: float = 0.0
    engine_hit_rate: float = 0.0  # from the engines' vllm:prefix_cache_* counters
    client_cached_share: float = 0.0  # cached / prompt tokens from the responses' usage
    ttft_p50_ms: float = float("nan")
    ttft_p90_ms: float = float("nan")
    ttft_p99_ms: float = float("nan")
    # Per turn ("0": conversations' first requests, which no cache holds; then later
    # turns, or depths in a tree): where a router's p90 comes from.
    ttft_p90_ms_by_turn: dict[str, float] = field(default_factory=dict)
    # Inter-token latency: the gaps between successive content chunks of a streamed
    # answer after its first (the engines stream a token a chunk), pooled over every
    # request of the cell (`itl_gaps` of them), each gap one sample; then the end-to-end
    # latency of the answered requests (sent to the stream's end).
    itl_p50_ms: float = float("nan")
    itl_p90_ms: float = float("nan")
    itl_p99_ms: float = float("nan")
    itl_gaps: int = 0
    e2e_p50_ms: float = float("nan")
    e2e_p90_ms: float = float("nan")
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    engine_requests: dict[str, float] = field(default_factory=dict)
    imbalance: float = 0.0  # busiest engine's requests over the mean
    preemptions: float = 0.0
    router_cpu_s: float = 0.0  # the router's processes (and kvplane's agents)
    cpu_s_by_process: dict[str, float] = field(default_factory=dict)
    # The same, by part of the deployment: "router" (a peer, kvplane's router replicas),
    # "agents" (kvplane's), "envoy" (the Envoys in front).
    cpu_s_by_part: dict[str, float] = field(default_factory=dict)
    cpu_ms_per_request: float = 0.0
    cpu_ms_per_request_by_part: dict[str, float] = field(default_factory=dict)
    rest_cpu_ms_per_s: float = 0.0  # the same processes with no traffic, before it
    evidence: dict[str, Any] = field(default_factory=dict)
    # Where the engines' prompt tokens came from (vllm:prompt_tokens_by_source), summed
    # over engines: computed (the fleet's prefill work), hit in the engine's own cache,
    # pulled from another engine (P/D). NaN where the engines do not export them.
    prompt_tokens_computed: float = float("nan")
    prompt_tokens_cache_hit: float = float("nan")
    prompt_tokens_pulled: float = float("nan")
    prompt_tokens_by_engine: dict[str, dict[str, float]] = field(default_factory=dict)
    # The router's own P/D counters over the traffic (kvplane's): split or whole and why
    # ("kvplane_legs_decided_total{reason=...,split=true}": n), fallbacks by reason,
    # prefill legs by outcome. Empty for a router that has none.
    pd_counters: dict[str, float] = field(default_factory=dict)
    # In front of a disaggregated fleet: whether P/D was in play, and if not, why. None
    # for an aggregated fleet.
    pd_in_play: bool | None = None
    pd_not_in_play: str = ""
    # Tenant workloads: blocks cached in the engines' unsalted scope at the end that were
    # not there when the traffic began (kvplane's wiring probes, `kvplane check`, are
    # unsalted: random words of their own). Any at all means a router dropped the
    # tenants' `cache_salt` and tenants shared cache.
    unsalted_blocks: int | None = None
    # The engines' cached blocks at the end of the traffic, every copy and the distinct
    # prefixes among them: how much of the fleet's cache held copies rather than more
    # prefixes; the same in the CPU tiers, and distinct over both. None: not read
    # (older results).
    held_blocks: int | None = None
    distinct_blocks: int | None = None
    host_held_blocks: int | None = None
    host_distinct_blocks: int | None = None
    distinct_blocks_any_tier: int | None = None
    # The noisy-tenant situation: C, the fleet's sustainable rate its workloads' rates
    # are fractions of (NaN elsewhere), and what each tenant got.
    capacity_per_s: float = float("nan")
    tenancy: TenantFigures | None = None

    @property
    def key(self) -> str:
        return cell_key(self.router, self.workload, self.load, self.situation, self.run)

    @property
    def split_requests(self) -> float:
        """Requests the router decided to split (kvplane's counters; 0 without them)."""
        return _counted(self.pd_counters, "kvplane_legs_decided_total", "split=true")

    @property
    def whole_requests(self) -> float:
        return _counted(self.pd_counters, "kvplane_legs_decided_total", "split=false")

    @property
    def fallbacks(self) -> float:
        return _counted(self.pd_counters, "kvplane_disaggregation_fallbacks_total")

    @property
    def pd_unexpected(self) -> str:
        """What the table and the progress line flag about P/D in this cell, or "": P/D
        not in play in front of a fleet that can split, or in play for the fleet's
        aggregated reference, which must split nothing."""
        if self.pd_reference and self.pd_in_play:
            pulled = 0.0 if math.isnan(self.prompt_tokens_pulled) else self.prompt_tokens_pulled
            return (
                f"P/D in play in the never-split reference: split "
                f"{self.split_requests:.0f}, pulled {pulled:.0f} prompt tokens"
            )
        if not self.pd_reference and self.pd_in_play is False:
            return f"P/D NOT in play: {self.pd_not_in_play}"
        return ""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> CellResult:
        """A result as `as_json` wrote it (fields added since then take their defaults)."""
        known = {spec.name for spec in fields(cls)}
        result = cls(**{name: value for name, value in document.items() if name in known})
        if isinstance(result.tenancy, dict):
            result.tenancy = TenantFigures(**result.tenancy)
        return result


def _counted(counters: dict[str, float], series: str, label: str = "") -> float:
    """The sum of a series' counts whose labels hold `label` ("split=true")."""
    return sum(
        value
        for name, value in counters.items()
        if name.partition("{")[0] == series and label in name.partition("{")[2]
    )


def run_cell(
    cell: Cell, *, duration_s: float, trace: Path, log_root: Path, shape: EngineShape
) -> CellResult:
    spec = cell.router
    shape = cell.shape(shape)
    result = CellResult(
        spec.name, spec.family, spec.policy, cell.workload, cell.load, cell.rate_per_s,
        cell.situation, cell.run, shape.fleet, spec.reference,
    )  # fmt: skip
    reason = spec.unavailable()
    if reason is not None:
        result.error = reason
        return result
    result.version = spec.version()
    workload = build_workload(cell.workload, cell.rate_per_s, duration_s, trace=trace)
    result.workload_description = workload.description
    children = Children(log_root / _slug(cell.key))
    try:
        fleet, deployment = _start(cell, workload, children, shape)
        result.commands = [shlex.join(child.command) for child in deployment.charged]
        # What the start did to the engines (kvplane's wiring probes) is not the cell's.
        totals_before = fleet.totals()
        unsalted_before = fleet.unsalted_blocks() if workload.tenants else set()
        result.rest_cpu_ms_per_s = _rest_cpu_ms_per_s(deployment)
        pd_before = deployment.pd_counters() if deployment.pd_counters else {}
        cpu_before = deployment.cpu_seconds()
        traffic = Traffic(
            deployment.urls,
            fleet.urls if cell.situation == "bypass" else (),
            BYPASS_SHARE if cell.situation == "bypass" else 0.0,
            seed=cell.run,
        )
        during = []
        if cell.situation == "engine-restart":
            during.append((workload.span_s / 2, _restarter(fleet)))
        started = time.perf_counter()
        started_at = time.time()  # as the outcomes' `sent_at`
        outcomes = asyncio.run(
            run_workload(
                workload,
                traffic,
                model=MODEL,
                api_key=lambda tenant: api_key(tenant or "anonymous"),
                deadline_s=workload.span_s + DRAIN_S,
                during=during,
            )
        )
        result.seconds = time.perf_counter() - started
        cpu_after = deployment.cpu_seconds()
        result.cpu_s_by_process = {
            name: round(cpu_after[name] - cpu_before.get(name, 0.0), 3) for name in cpu_after
        }
        result.router_cpu_s = sum(result.cpu_s_by_process.values())
        result.cpu_s_by_part = {
            part: round(seconds, 3)
            for part, seconds in deployment.by_part(result.cpu_s_by_process).items()
        }
        _figures(result, outcomes, fleet, totals_before, tiered=shape.cpu_offload_blocks > 0)
        blocks = fleet.fleet_blocks()
        result.held_blocks, result.distinct_blocks = blocks.held, blocks.distinct
        result.host_held_blocks, result.host_distinct_blocks = (
            blocks.host_held,
            blocks.host_distinct,
        )
        result.distinct_blocks_any_tier = blocks.distinct_any_tier
        _write_requests(children.log_dir / REQUESTS_FILE, outcomes)
        if cell.situation == NOISY_SITUATION:
            result.capacity_per_s = cell.capacity_per_s
            result.tenancy = tenant_figures(
                outcomes,
                started_at=started_at,
                span_s=workload.span_s,
                tenants=workload.tenants,
                # The flood's groups (its solo run's well-behaved tenants pooled too);
                # the shares measurement's tenants each their own.
                noisy=NOISY_TENANT if workload.name in NOISY_WORKLOADS else None,
                shares=workload.shares,
            )
        if workload.tenants:
            result.unsalted_blocks = len(fleet.unsalted_blocks() - unsalted_before)
        result.evidence = deployment.in_play()
        if deployment.pd_counters is not None:
            after = deployment.pd_counters()
            result.pd_counters = {
                name: value - pd_before.get(name, 0.0)
                for name, value in after.items()
                if value - pd_before.get(name, 0.0)
            }
        if shape.connector:
            _pd_in_play(
                result,
                fleet,
                kvplane_counters=deployment.pd_counters is not None,
                reference=spec.reference,
            )
    except (StartFailed, BlindFleet, OSError, RuntimeError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        children.stop_all()
    return result


def _start(
    cell: Cell, workload: Workload, children: Children, shape: EngineShape
) -> tuple[RunningEngines, Deployment]:
    """The cell's engines and router, started once more if the first start fails: a
    start is not a measurement, and starts have failed for reasons of the machine's, not
    the router's (a port picked free and bound by another process a moment later; a
    peer's first start on a fresh machine taking over a minute to report ready)."""

    def start() -> tuple[RunningEngines, Deployment]:
        fleet = start_engines(children, shape)
        return fleet, cell.router.start(cell.router, fleet, children, cell.replicas, workload)

    try:
        return start()
    except StartFailed:
        children.stop_all()
        return start()


def _restarter(fleet: RunningEngines) -> Callable[[], Awaitable[None]]:
    async def restart() -> None:
        await asyncio.to_thread(fleet.restart, 0)

    return restart


REQUESTS_FILE = "requests.jsonl"
"""Beside a cell's logs: one line per request (its turn, TTFT, end-to-end latency,
inter-token gaps, tokens, when it was sent; never its text), to read a percentile's
requests against the router's decisions."""


def _write_requests(path: Path, outcomes: list[Outcome]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lines:
        for outcome in outcomes:
            lines.write(json.dumps(asdict(outcome)) + "\n")


def _figures(
    result: CellResult,
    outcomes: list[Outcome],
    fleet: RunningEngines,
    before: dict[str, EngineTotals],
    *,
    tiered: bool,
) -> None:
    result.requests = len(outcomes)
    result.shed = sum(outcome.shed for outcome in outcomes)
    result.failed = sum(not outcome.ok and not outcome.shed for outcome in outcomes)
    latencies(result, outcomes)
    done = [outcome for outcome in outcomes if outcome.ok]
    prompt = sum(outcome.prompt_tokens for outcome in done)
    result.client_cached_share = sum(o.cached_tokens for o in done) / prompt if prompt else 0.0
    result.requests_per_s = len(done) / result.seconds if result.seconds else 0.0
    result.output_tokens_per_s = (
        sum(o.output_tokens for o in done) / result.seconds if result.seconds else 0.0
    )
    totals = {
        name: total.since(before.get(name, EngineTotals()))
        for name, total in fleet.totals().items()
    }
    # With a CPU tier, a prefix read back from host memory is a hit too (the connector's
    # counters); a decode engine's pulls are not (in P/D, a hit is the engine's own).
    result.engine_hit_rate = hit_rate(list(totals.values()), external=tiered)
    result.engine_requests = {name: total.requests for name, total in totals.items()}
    counts = list(result.engine_requests.values())
    mean = statistics.fmean(counts) if counts else 0.0
    result.imbalance = max(counts) / mean if mean else 0.0
    result.preemptions = sum(total.preemptions for total in totals.values())
    result.prompt_tokens_by_engine = {
        name: dict(sorted(total.prompt_tokens_by_source.items())) for name, total in totals.items()
    }
    if any(total.prompt_tokens_by_source for total in totals.values()):
        by_source = [total.prompt_tokens_by_source for total in totals.values()]
        result.prompt_tokens_computed = sum(s.get(LOCAL_COMPUTE, 0.0) for s in by_source)
        result.prompt_tokens_cache_hit = sum(s.get(LOCAL_CACHE_HIT, 0.0) for s in by_source)
        result.prompt_tokens_pulled = sum(s.get(EXTERNAL_KV_TRANSFER, 0.0) for s in by_source)
    routed = sum(not outcome.direct for outcome in outcomes)
    result.cpu_ms_per_request = result.router_cpu_s * 1000 / routed if routed else 0.0
    result.cpu_ms_per_request_by_part = {
        part: round(seconds * 1000 / routed, 3) if routed else 0.0
        for part, seconds in result.cpu_s_by_part.items()
    }


def latencies(result: CellResult, outcomes: list[Outcome]) -> None:
    """The cell's TTFT (every request's first content chunk, by turn too), inter-token
    latency (every gap between successive content chunks of every request, pooled) and
    end-to-end latency (the answered requests') percentiles, in ms."""
    ttfts = [outcome.ttft_s for outcome in outcomes if outcome.ttft_s is not None]
    result.ttft_p50_ms = percentile(ttfts, 0.5) * 1000
    result.ttft_p90_ms = percentile(ttfts, 0.9) * 1000
    result.ttft_p99_ms = percentile(ttfts, 0.99) * 1000
    by_turn: dict[int, list[float]] = {}
    for outcome in outcomes:
        if outcome.ttft_s is not None:
            by_turn.setdefault(outcome.turn, []).append(outcome.ttft_s)
    result.ttft_p90_ms_by_turn = {
        str(turn): percentile(by_turn[turn], 0.9) * 1000 for turn in sorted(by_turn)
    }
    gaps = [gap for outcome in outcomes for gap in outcome.itl_s]
    result.itl_gaps = len(gaps)
    result.itl_p50_ms = percentile(gaps, 0.5) * 1000
    result.itl_p90_ms = percentile(gaps, 0.9) * 1000
    result.itl_p99_ms = percentile(gaps, 0.99) * 1000
    ends = [o.latency_s for o in outcomes if o.ok and o.latency_s is not None]
    result.e2e_p50_ms = percentile(ends, 0.5) * 1000
    result.e2e_p90_ms = percentile(ends, 0.9) * 1000


def _pd_in_play(
    result: CellResult,
    fleet: RunningEngines,
    *,
    kvplane_counters: bool,
    reference: bool = False,
) -> None:
    """Whether P/D was in play in a cell whose fleet can split: the engines that take
    decode legs (the decode pool, or every engine of the `pd-both` fleet) pulled prompt
    tokens, and a router that counts its decisions (kvplane) split requests.
    `pd_not_in_play` says what was missing. For a fleet's aggregated `reference` (it
    must split nothing) P/D in play is any split or any pull, and what it says of one
    that stayed whole is the evidence (`whole: never N`)."""
    decode = {engine.name for engine in fleet.engines if engine.role != "prefill"}
    pools = any(engine.role == "decode" for engine in fleet.engines)
    by_engine = result.prompt_tokens_by_engine
    pulled = any(by_engine.get(name, {}).get(EXTERNAL_KV_TRANSFER, 0.0) > 0 for name in decode)
    missing = []
    if not any(by_engine.get(name) for name in decode):
        missing.append("the engines do not count prompt tokens by source")
    elif not pulled:
        missing.append(
            "the decode engines pulled no prompt token"
            if pools
            else "no engine pulled a prompt token"
        )
    if kvplane_counters and result.split_requests <= 0:
        whole = {
            name.partition("reason=")[2].partition(",")[0].rstrip("}"): value
            for name, value in result.pd_counters.items()
            if name.startswith("kvplane_legs_decided_total") and "split=false" in name
        }
        reasons = ", ".join(f"{reason} {value:.0f}" for reason, value in whole.items())
        missing.append(f"no request split (whole: {reasons or 'none counted'})")
    result.pd_not_in_play = "; ".join(missing)
    if reference:
        result.pd_in_play = pulled or result.split_requests > 0
        return
    result.pd_in_play = not missing


def _rest_cpu_ms_per_s(deployment: Deployment) -> float:
    """The CPU the router's processes spend a second with no request to serve (for
    kvplane: the agents' probes and heartbeats, the router's answers to them)."""
    before = deployment.cpu_seconds()
    time.sleep(REST_S)
    after = deployment.cpu_seconds()
    return round(sum(after[name] - before.get(name, 0.0) for name in after) * 1000 / REST_S, 2)


def _slug(text: str) -> str:
    return "".join(char if char.isalnum() or char in "-." else "_" for char in text).strip("_")


def default_log_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvplane-bench-live-"))
