"""`kvplane bench scale`: the shared index at a fleet's scale: many workers, several
router replicas, one Redis Cluster.

Each point (workers x routers) starts from nothing: a Redis Cluster of three masters,
each with a replica (`simulations/redis_servers.py`); `routers` `kvplane router`
processes on it (the `redis-cluster` index, worker credentials on); one engine simulator
(time scale 0) that every worker names as its engine, so requests are proxied and
answered; and a synthetic fleet in a child process (`simulations/synthetic_fleet.py`):
`workers` agents speaking the real wire contract, spread over the routers in turn.

Phases:
1. fill: every worker registers and fills its cache (one of eight shared 1,024-token
   system prompts, then requests of `request_blocks` blocks up to `capacity_blocks`),
   as fast as its batches are acknowledged. Redis' memory (used_memory over the
   masters, less what it used before) per entry and per worker is read after it.
   Before measuring, every router must list every worker and find a system prompt's
   holders in the index: figures of an index nobody fills are not figures.
2. rest: the fleet's batches paused, its load reports going on: the routers' and
   Redis' CPU a second at rest, taken out of the per-event and per-request figures.
3. ingest: every worker sends `batches_per_s` batches a second (Poisson), each one
   finished request's blocks stored and its oldest request's removed. Events and
   blocks applied a second (the routers' counters), the routers' CPU (user + system)
   and Redis' per event, less their CPU at rest.
4. mixed: the same events, and requests arriving at `request_rate` a second (Poisson;
   an open loop: a closed one measures the machine's saturation), round robin over the
   routers: `/v1/completions` with a system prompt and 64 new tokens, max_tokens 1.
   Decision and lookup latency from the routers' own histograms
   (`kvplane_decision_seconds`: key, look up, score; the share of decisions within
   5 ms is read off its bucket exactly, p50/p99 interpolated within a bucket).
5. quiet: the fleet paused again, the same requests:
   the decision latency of the index alone, and the routers' and Redis' CPU per
   request, less their CPU at rest.
Apply lag: from a batch's sending to its acknowledgement, which the control plane sends
once the index applied it, over the ingest and mixed phases. The index's own entry
count (`GET /fleet/index`) is read after the mixed phase, with how long it took.

Everything shares the machine's cores: on a small machine the figures are the whole
system's, the fleet's and the load's own work included. Each phase reads the machine's
idle share (/proc/stat); where a phase that a per-event or per-request CPU figure rests
on left less than SATURATED_IDLE_SHARE idle, the figure is not given (nan).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import multiprocessing
import platform
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvplane.core.serving import free_port
from router.check import TOKEN_VARIABLE
from router.index.redis import KeyLayout
from simulations.engine_sim.process import spawn_engine_sim
from simulations.processes import start_kvplane
from simulations.redis_servers import RunningCluster, redis_cluster
from simulations.synthetic_fleet import (
    FILLED,
    PAUSE,
    RESUME,
    STEADY,
    STOP,
    TOKEN_IDS,
    FleetReport,
    FleetShape,
    run_fleet_process,
)

MODEL = "kvplane-tiny"  # the engine simulator's default model name
ADMIN_TOKEN = "bench-scale-admin"  # loopback only
REDIS_PREFIX = "kvp"  # the routers' default index.redis_prefix
WORKER_SECRET = "bench-scale-worker-secret-of-32-chars-at-least"
DECISION_TARGET_S = 0.005
SATURATED_IDLE_SHARE = 0.1
"""A phase in which the machine's cores were idle less than this share of the time was
saturated: what the rest phase cost is then no baseline for it (work added displaces
other work instead of adding CPU), and the per-event or per-request CPU is not given."""
QUESTION_TOKENS = 64
FILL_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ScaleFigures:
    workers: int
    routers: int
    entries: int  # what the workers hold at the end (each acknowledged)
    index_entries: int  # what the index counts (GET /fleet/index); -1: it did not answer
    stats_s: float  # how long that took
    fill_s: float
    redis_bytes_per_entry: float
    redis_bytes_per_worker: float
    events_per_s: float  # applied, all routers
    events_per_s_per_router: float
    blocks_per_s: float
    apply_lag_p50_ms: float
    apply_lag_p99_ms: float
    # CPU a second with nothing but the workers' load reports and upkeep (all routers;
    # every Redis node), taken out of the per-event and per-request figures.
    router_cpu_ms_per_s_at_rest: float
    redis_cpu_ms_per_s_at_rest: float
    router_cpu_ms_per_event: float
    redis_cpu_ms_per_event: float
    requests: int
    requests_per_s: float
    decision_p50_ms: float
    decision_p99_ms: float
    decisions_within_5ms: float  # share of the routers' decisions
    lookup_p50_ms: float
    lookup_p99_ms: float
    # With the fleet's batches paused: requests alone.
    quiet_decision_p50_ms: float
    quiet_decision_p99_ms: float
    router_cpu_ms_per_request: float
    redis_cpu_ms_per_request: float
    # The machine's idle share of its cores in the rest, ingest and quiet phases (nan
    # where /proc/stat cannot be read). Below SATURATED_IDLE_SHARE in a phase the CPU a
    # thing costs cannot be told from what it displaces: the per-event (rest, ingest)
    # and per-request (rest, quiet) figures are nan then.
    idle_share_rest: float
    idle_share_ingest: float
    idle_share_quiet: float
    failed_requests: int
    failed_workers: int
    reconnects: int  # streams the workers opened again (the control plane ended one)


# -- reading the routers --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouterProbe:
    url: str
    pid: int

    def scrape(self) -> dict[str, Any]:
        """Counters and histogram buckets this benchmark reads, and the CPU seconds."""
        text = httpx.get(
            self.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
        ).text
        # When the counters were read: a phase's rates run between its two scrapes (at
        # 1,000 workers a scrape takes a router a second or more: its stats() call).
        figures: dict[str, Any] = {"cpu_s": _cpu_seconds(self.pid), "at": time.monotonic()}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("kvplane_events_applied_total", "kvplane_blocks_applied_total"):
                    figures[sample.name] = figures.get(sample.name, 0.0) + sample.value
                elif sample.name in (
                    "kvplane_decision_seconds_bucket",
                    "kvplane_lookup_seconds_bucket",
                ):
                    buckets = figures.setdefault(sample.name, {})
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
        return figures

    def index_statistics(self) -> tuple[int, float]:
        """The index's entry count (`GET /fleet/index`, -1 where it did not answer in
        STATS_TIMEOUT_S) and the seconds it took."""
        started = time.monotonic()
        try:
            response = httpx.get(
                self.url + "/fleet/index",
                headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=STATS_TIMEOUT_S,
            )
        except httpx.TransportError:
            return -1, time.monotonic() - started
        seconds = time.monotonic() - started
        return (int(response.json()["entries"]) if response.status_code == 200 else -1), seconds


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _delta(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], name: str) -> float:
    return float(
        sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True))
    )


def bucket_delta(
    before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], name: str
) -> dict[float, float]:
    total: dict[float, float] = {}
    for b, a in zip(before, after, strict=True):
        for bound, count in a.get(name, {}).items():
            total[bound] = total.get(bound, 0.0) + count - b.get(name, {}).get(bound, 0.0)
    return dict(sorted(total.items()))


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The `q` quantile of a cumulative histogram (upper bound -> count), linear within
    its bucket as Prometheus' histogram_quantile is; NaN when it is empty, the largest
    finite bound when the quantile lies in the +Inf bucket."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets.items():
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def share_within(buckets: dict[float, float], bound: float) -> float:
    """The share of observations at most `bound` (a bucket bound: exact)."""
    total = buckets.get(math.inf, 0.0)
    return math.nan if total <= 0 else buckets.get(bound, math.nan) / total


# -- Redis ----------------------------------------------------------------------------


def _redis_totals(cluster: RunningCluster) -> tuple[float, float]:
    """used_memory over the masters, and CPU seconds over every node."""
    memory = sum(float(node.info("memory")["used_memory"]) for node in cluster.masters())
    cpu = 0.0
    for node in cluster.nodes:
        if node.alive:
            info = node.info("cpu")
            cpu += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return memory, cpu


# -- the point's processes ------------------------------------------------------------


@dataclass(slots=True)
class RouterReplica:
    """One `kvplane router` process, which a fault sitting may kill and start again on
    the same ports."""

    args: list[str]
    url: str
    grpc_address: str
    layout: KeyLayout  # the index's groups, and whether they keep directories
    process: subprocess.Popen[bytes] | None = None

    def start(self, redis_url: str) -> None:
        """Start it on the cluster `redis_url` names (a live node: it learns the rest)."""
        env = {
            TOKEN_VARIABLE: ADMIN_TOKEN,
            "KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET": WORKER_SECRET,
            "KVPLANE_INDEX__REDIS_GROUPS": str(self.layout.groups),
            "KVPLANE_INDEX__REDIS_DIRECTORY": "true" if self.layout.directory else "false",
        }
        args = [*self.args, "--index", "redis-cluster", "--redis-url", redis_url]
        self.process = start_kvplane(args, self.url + "/healthz", env=env)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    @property
    def probe(self) -> RouterProbe:
        assert self.process is not None
        return RouterProbe(self.url, self.process.pid)


@dataclass(frozen=True, slots=True)
class RunningPoint:
    cluster: RunningCluster
    replicas: list[RouterReplica]
    engine_url: str
    layout: KeyLayout  # the index's keys, as the routers name them

    @property
    def routers(self) -> list[RouterProbe]:
        return [replica.probe for replica in self.replicas]

    @property
    def grpc_addresses(self) -> list[str]:
        return [replica.grpc_address for replica in self.replicas]


@contextmanager
def running_point(workdir: Path, routers: int, layout: KeyLayout) -> Iterator[RunningPoint]:
    quiet = ("--log-level", "WARNING")
    with ExitStack() as stack:
        cluster = stack.enter_context(redis_cluster(workdir, masters=3, replicas=1))
        engine = stack.enter_context(spawn_engine_sim("--time-scale", "0", *quiet))
        replicas = []
        for _ in range(routers):
            grpc_port, http_port = free_port(), free_port()
            replica = RouterReplica(
                ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port), *quiet],
                f"http://127.0.0.1:{http_port}",
                f"127.0.0.1:{grpc_port}",
                layout,
            )  # fmt: skip
            stack.callback(replica.kill)
            replica.start(cluster.url)
            replicas.append(replica)
        yield RunningPoint(cluster, replicas, engine.base_url, layout)


@contextmanager
def fleet_process(shape: FleetShape, addresses: Sequence[str]) -> Iterator[Connection]:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=run_fleet_process, args=(shape, addresses, theirs))
    process.start()
    try:
        yield ours
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()


def await_message(conn: Connection, expected: str, timeout_s: float) -> None:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the synthetic fleet did not say {expected!r} in {timeout_s:g} s")
    message = conn.recv()
    if message != expected:
        raise RuntimeError(f"the synthetic fleet said {message!r}, not {expected!r}")


def require_in_play(point: RunningPoint, shape: FleetShape) -> None:
    """Every router lists every worker, and finds a system prompt's holders in the index
    (a lookup that matches nothing measures nothing)."""
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    holders = math.ceil(shape.workers / shape.system_prompts)  # workers holding prompt 0
    query = {"model": MODEL, "token_ids": shape.system_prompt(0)}
    deadline = time.monotonic() + 30
    for router in point.routers:
        while True:
            workers = httpx.get(router.url + "/fleet/workers", headers=headers, timeout=30).json()
            answer = httpx.post(
                router.url + "/fleet/locality", headers=headers, json=query, timeout=30
            ).json()
            matched = sum(1 for row in answer.get("workers", []) if row["cached_tokens"] > 0)
            if len(workers.get("workers", [])) == shape.workers and matched >= holders:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"router {router.url} lists {len(workers.get('workers', []))} of "
                    f"{shape.workers} workers and finds {matched} of {holders} holders of a "
                    "system prompt: the index is not in play"
                )
            time.sleep(0.5)


# -- the request load -----------------------------------------------------------------


async def open_loop(
    urls: Sequence[str], shape: FleetShape, rate_per_s: float, duration_s: float
) -> tuple[int, int]:
    """Requests arriving at `rate_per_s` (Poisson) for `duration_s`, round robin over
    the routers, each sent as it arrives whatever is still in flight (a closed loop
    would measure the machine's saturation, not the index): (answered, failed)."""
    prompts = [shape.system_prompt(index) for index in range(shape.system_prompts)]
    rng = random.Random("requests")
    targets = itertools.cycle(urls)
    outcomes: list[bool] = []

    async def send(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        try:
            response = await http.post(url + "/v1/completions", json=body)
            outcomes.append(response.status_code == 200)
        except httpx.TransportError:
            outcomes.append(False)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=256)) as http:
        tasks = []
        start = time.monotonic()
        arrival = 0.0
        while True:
            arrival += rng.expovariate(rate_per_s)
            if arrival >= duration_s:
                break
            await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
            question = [rng.randrange(1, TOKEN_IDS) for _ in range(QUESTION_TOKENS)]
            body = {"model": MODEL, "prompt": rng.choice(prompts) + question, "max_tokens": 1}
            tasks.append(asyncio.ensure_future(send(http, next(targets), body)))
        await asyncio.gather(*tasks)
    answered = sum(outcomes)
    return answered, len(outcomes) - answered


# -- one point ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Phase:
    """What the routers and Redis did over one phase, and the requests' outcome."""

    before: list[dict[str, Any]]  # each router's scrape
    after: list[dict[str, Any]]
    redis_cpu_s: float
    seconds: float
    idle_share: float  # of the machine's cores (nan: unknown)
    answered: int = 0
    failed: int = 0

    def delta(self, name: str) -> float:
        return _delta(self.before, self.after, name)

    @property
    def span_s(self) -> float:
        """The routers' counters' time between the phase's scrapes (the mean over the
        routers): what their rates are over."""
        return _delta(self.before, self.after, "at") / len(self.before)

    def buckets(self, name: str) -> dict[float, float]:
        return bucket_delta(self.before, self.after, name)


def _phase(
    point: RunningPoint, shape: FleetShape, duration_s: float, request_rate: float | None
) -> Phase:
    """`duration_s` of what the fleet sends, with requests at `request_rate` if given."""
    before = [router.scrape() for router in point.routers]
    _, redis_cpu = _redis_totals(point.cluster)
    machine_before = machine_cpu_ticks()
    started = time.monotonic()
    answered = failed = 0
    if request_rate is None:
        time.sleep(duration_s)
    else:
        urls = [router.url for router in point.routers]
        answered, failed = asyncio.run(open_loop(urls, shape, request_rate, duration_s))
    seconds = time.monotonic() - started
    idle = idle_share(machine_before, machine_cpu_ticks())
    after = [router.scrape() for router in point.routers]
    _, redis_cpu_after = _redis_totals(point.cluster)
    return Phase(before, after, redis_cpu_after - redis_cpu, seconds, idle, answered, failed)


def machine_cpu_ticks() -> tuple[int, int] | None:
    """(idle, total) CPU ticks of every core since boot, from /proc/stat; None where it
    cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice, within user]
    return fields[3] + fields[4], sum(fields[:8])


def idle_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """The share of the machine's CPU time idle between two readings; nan if unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return math.nan
    return (after[0] - before[0]) / (after[1] - before[1])


def measure_point(
    workdir: Path,
    shape: FleetShape,
    routers: int,
    *,
    duration_s: float,
    request_rate: float,
    layout: KeyLayout,
) -> ScaleFigures:
    with running_point(workdir, routers, layout) as point:
        shape = dataclasses.replace(shape, base_url=point.engine_url)
        memory_before, _ = _redis_totals(point.cluster)
        with fleet_process(shape, point.grpc_addresses) as fleet:
            started = time.monotonic()
            await_message(fleet, FILLED, FILL_TIMEOUT_S)
            fill_s = time.monotonic() - started
            require_in_play(point, shape)
            memory_after, _ = _redis_totals(point.cluster)
            fleet.send(PAUSE)
            time.sleep(1.0)  # the batches in flight are acknowledged
            rest = _phase(point, shape, duration_s, None)
            fleet.send(RESUME)
            fleet.send(STEADY)
            ingest = _phase(point, shape, duration_s, None)
            mixed = _phase(point, shape, duration_s, request_rate)
            index_entries, stats_s = point.routers[0].index_statistics()
            fleet.send(PAUSE)
            time.sleep(1.0)  # the batches in flight are acknowledged
            quiet = _phase(point, shape, duration_s, request_rate)
            fleet.send(STOP)
            if not fleet.poll(60):
                raise TimeoutError("the synthetic fleet sent no report")
            report: FleetReport = fleet.recv()
    for failure in report.failed:
        print(f"  a synthetic worker failed: {failure}", flush=True)
    return _figures(
        shape, routers, report, fill_s, memory_after - memory_before,
        (rest, ingest, mixed, quiet), index_entries, stats_s,
    )  # fmt: skip


def _figures(
    shape: FleetShape,
    routers: int,
    report: FleetReport,
    fill_s: float,
    redis_bytes: float,
    phases: tuple[Phase, Phase, Phase, Phase],
    index_entries: int,
    stats_s: float,
) -> ScaleFigures:
    rest, ingest, mixed, quiet = phases
    events = ingest.delta("kvplane_events_applied_total")
    # nan comparisons are False: an unknown idle share leaves the figures as measured.
    per_event_measurable = not any(p.idle_share < SATURATED_IDLE_SHARE for p in (rest, ingest))
    per_request_measurable = not any(p.idle_share < SATURATED_IDLE_SHARE for p in (rest, quiet))
    # Each router's upkeep and the workers' load reports go on in every phase: what
    # the rest phase cost a second is taken out of the others'.
    router_rest = rest.delta("cpu_s") / rest.span_s
    redis_rest = rest.redis_cpu_s / rest.span_s

    def router_cpu(phase: Phase) -> float:
        return phase.delta("cpu_s") - router_rest * phase.span_s

    def redis_cpu(phase: Phase) -> float:
        return phase.redis_cpu_s - redis_rest * phase.span_s

    decisions = mixed.buckets("kvplane_decision_seconds_bucket")
    quiet_decisions = quiet.buckets("kvplane_decision_seconds_bucket")
    lags = sorted(report.ack_seconds)
    entries = report.held_blocks

    def ms(seconds: float, digits: int = 3) -> float:
        return round(seconds * 1000, digits)

    return ScaleFigures(
        workers=shape.workers,
        routers=routers,
        entries=entries,
        index_entries=index_entries,
        stats_s=round(stats_s, 2),
        fill_s=round(fill_s, 1),
        redis_bytes_per_entry=round(redis_bytes / entries, 1) if entries else math.nan,
        redis_bytes_per_worker=round(redis_bytes / shape.workers),
        events_per_s=round(events / ingest.span_s, 1),
        events_per_s_per_router=round(events / ingest.span_s / routers, 1),
        blocks_per_s=round(ingest.delta("kvplane_blocks_applied_total") / ingest.span_s),
        apply_lag_p50_ms=ms(_quantile(lags, 0.5), 2),
        apply_lag_p99_ms=ms(_quantile(lags, 0.99), 2),
        router_cpu_ms_per_s_at_rest=ms(router_rest, 1),
        redis_cpu_ms_per_s_at_rest=ms(redis_rest, 1),
        router_cpu_ms_per_event=(
            ms(router_cpu(ingest) / events) if events and per_event_measurable else math.nan
        ),
        redis_cpu_ms_per_event=(
            ms(redis_cpu(ingest) / events) if events and per_event_measurable else math.nan
        ),
        requests=mixed.answered,
        requests_per_s=round(mixed.answered / mixed.seconds, 1),
        decision_p50_ms=ms(bucket_quantile(decisions, 0.5)),
        decision_p99_ms=ms(bucket_quantile(decisions, 0.99)),
        decisions_within_5ms=round(share_within(decisions, DECISION_TARGET_S), 4),
        lookup_p50_ms=ms(bucket_quantile(mixed.buckets("kvplane_lookup_seconds_bucket"), 0.5)),
        lookup_p99_ms=ms(bucket_quantile(mixed.buckets("kvplane_lookup_seconds_bucket"), 0.99)),
        quiet_decision_p50_ms=ms(bucket_quantile(quiet_decisions, 0.5)),
        quiet_decision_p99_ms=ms(bucket_quantile(quiet_decisions, 0.99)),
        router_cpu_ms_per_request=(
            ms(router_cpu(quiet) / quiet.answered)
            if quiet.answered and per_request_measurable
            else math.nan
        ),
        redis_cpu_ms_per_request=(
            ms(redis_cpu(quiet) / quiet.answered)
            if quiet.answered and per_request_measurable
            else math.nan
        ),
        idle_share_rest=round(rest.idle_share, 3),
        idle_share_ingest=round(ingest.idle_share, 3),
        idle_share_quiet=round(quiet.idle_share, 3),
        failed_requests=mixed.failed + quiet.failed,
        failed_workers=report.failures,
        reconnects=report.reconnects,
    )


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


# -- the command ----------------------------------------------------------------------

COLUMNS = (
    ("workers", "workers"),
    ("routers", "routers"),
    ("entries", "entries"),
    ("index_entries", "in index"),
    ("stats_s", "stats s"),
    ("fill_s", "fill s"),
    ("redis_bytes_per_entry", "Redis B/entry"),
    ("events_per_s", "events/s"),
    ("events_per_s_per_router", "per router"),
    ("apply_lag_p50_ms", "lag p50 ms"),
    ("apply_lag_p99_ms", "lag p99 ms"),
    ("router_cpu_ms_per_s_at_rest", "rest CPU ms/s"),
    ("router_cpu_ms_per_event", "CPU ms/event"),
    ("redis_cpu_ms_per_event", "Redis ms/event"),
    ("requests_per_s", "req/s"),
    ("decision_p50_ms", "decide p50 ms"),
    ("decision_p99_ms", "decide p99 ms"),
    ("decisions_within_5ms", "<=5 ms"),
    ("lookup_p99_ms", "lookup p99 ms"),
    ("quiet_decision_p50_ms", "quiet p50 ms"),
    ("quiet_decision_p99_ms", "quiet p99 ms"),
    ("router_cpu_ms_per_request", "CPU ms/req"),
    ("redis_cpu_ms_per_request", "Redis ms/req"),
    ("idle_share_quiet", "idle quiet"),
    ("failed_requests", "failed req"),
    ("failed_workers", "failed workers"),
    ("reconnects", "reconnects"),
)


def _table(results: Sequence[ScaleFigures]) -> str:
    from simulations.reporting import format_table

    rows = [[str(getattr(figures, name)) for name, _ in COLUMNS] for figures in results]
    return format_table([[label for _, label in COLUMNS], *rows])


def fleet_shape(
    workers: int, capacity_blocks: int, request_blocks: int, batches_per_s: float
) -> FleetShape:
    return FleetShape(
        workers=workers,
        model=MODEL,
        base_url="",  # the point's engine simulator's (measure_point)
        capacity_blocks=capacity_blocks,
        request_blocks=request_blocks,
        batches_per_s=batches_per_s,
        worker_secret=WORKER_SECRET,
    )


def run_scale_benchmark(
    *,
    json_path: Path | None,
    workers: Sequence[int],
    routers: Sequence[int],
    duration_s: float,
    batches_per_s: float,
    capacity_blocks: int,
    request_blocks: int,
    request_rate: float,
    layout: KeyLayout,
    plot: Path | None = None,
) -> int:
    shapes = [
        fleet_shape(count, capacity_blocks, request_blocks, batches_per_s) for count in workers
    ]
    results: list[ScaleFigures] = []
    for shape, replicas in itertools.product(shapes, routers):
        count = shape.workers
        with tempfile.TemporaryDirectory(prefix="kvplane-bench-scale-") as workdir:
            print(f"{count} workers, {replicas} routers ...", flush=True)
            figures = measure_point(
                Path(workdir),
                shape,
                replicas,
                duration_s=duration_s,
                request_rate=request_rate,
                layout=layout,
            )
        results.append(figures)
        print(_table([figures]), flush=True)
    print()
    print(_table(results))
    document = {
        "benchmark": "scale",
        "machine": {"cpus": psutil.cpu_count(), "python": platform.python_version()},
        "shape": {
            "duration_s": duration_s,
            "batches_per_s_per_worker": batches_per_s,
            "capacity_blocks": capacity_blocks,
            "request_blocks": request_blocks,
            "requests_per_s": request_rate,
            "index_groups": layout.groups,
            "index_directory": layout.directory,
        },
        "points": [asdict(figures) for figures in results],
    }
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=2) + "\n")
    if plot is not None:
        _plot(results, plot)
    return 0


def _plot(results: Sequence[ScaleFigures], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("events_per_s", "events applied /s"),
        ("apply_lag_p99_ms", "apply lag p99 (ms)"),
        ("decision_p99_ms", "decision p99 (ms)"),
        ("redis_bytes_per_entry", "Redis bytes / entry"),
        ("router_cpu_ms_per_event", "router CPU ms / event"),
        ("router_cpu_ms_per_request", "router CPU ms / request"),
    )
    figure, axes = plt.subplots(2, 3, figsize=(14, 8))
    for axis, (name, label) in zip(axes.flat, panels, strict=True):
        for replicas in sorted({r.routers for r in results}):
            points = sorted((r.workers, getattr(r, name)) for r in results if r.routers == replicas)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                      label=f"{replicas} router(s)")  # fmt: skip
        axis.set_xscale("log")
        axis.set_xlabel("workers")
        axis.set_title(label)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
