"""`kvplane bench scale --faults`: what a fleet at scale goes through when a part of its
shared index fails, at each point (workers x routers) of `kvplane bench scale`, on the
same processes (benchmarks/scale.py starts them) and under the same load: the fleet's
batches at their rate, and requests through every router at the request rate.

1. Failover: the Redis Cluster master that serves the most workers is killed
   (SIGKILL). Measured from its death: when its replica serves as master (the
   cluster's own failover) and the cluster says ok; when each router went load-only
   and when it routed on the index again (its `/readyz`, polled every 0.2 s); the
   requests' outcome and decision latency meanwhile; the resyncs the routers asked for
   because the promoted replica lacked writes (`index_lost_writes`).
2. Router restart: the first router replica is killed and started again on its ports
   after `RESTART_DOWN_S`. Its agents stream to the next replica meanwhile, resuming
   under their incarnations where the index says they left off (or starting new ones
   where it cannot). Measured: how long the restarted router takes to answer, and to
   find a system prompt's holders in the index (`/fleet/locality`), from its start.

After each, with the fleet's batches paused and every worker settled, an audit compares
the index with what every worker caches, block by block: nothing an agent holds may be
missing, nothing it does not hold may be left, and every worker's hash must record the
incarnation it streams under.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import psutil
from redis.crc import key_slot

from benchmarks.scale import (
    ADMIN_TOKEN,
    FILL_TIMEOUT_S,
    MODEL,
    RunningPoint,
    await_message,
    bucket_delta,
    bucket_quantile,
    fleet_process,
    open_loop,
    require_in_play,
    running_point,
)
from router.index.redis import KeyLayout
from simulations.redis_servers import ClusterNode
from simulations.synthetic_fleet import (
    AUDIT,
    FILLED,
    PAUSE,
    REPORT,
    RESUME,
    STEADY,
    STOP,
    Audit,
    FleetReport,
    FleetShape,
)

WARM_S = 3.0  # of load before each fault
FAILOVER_TIMEOUT_S = 60.0
RESTART_DOWN_S = 3.0
POLL_S = 0.2
TAIL_S = 5.0
SETTLE_S = 1.0  # batches in flight acknowledged after a pause
HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}
AUDITS = 3
AUDIT_RETRY_S = 6.0  # past a lease (5 s): every agent has heard whether it is still held


@dataclass(frozen=True, slots=True)
class FailoverFigures:
    promoted_s: float  # from the master's death to its replica serving as master
    cluster_ok_s: float  # ... to every live node saying cluster_state:ok
    routers_load_only: int  # routers whose /readyz said load-only meanwhile
    load_only_s: float  # from the death to the first router saying load-only
    index_back_s: float  # ... to the last of them routing on the index again
    back_after_failover_s: float  # index_back_s - promoted_s
    # The routers' /readyz samples that said cache-aware over the window's last
    # TAIL_S (where the machine is saturated, lookups past proxy.index_timeout_s flip a
    # router to load-only and back without any fault).
    cache_aware_share_at_end: float
    requests: int
    failed_requests: int
    decision_p99_ms: float  # over the window
    lost_write_resyncs: int  # kvplane_resyncs_total{reason="index_lost_writes"}
    new_incarnations: int  # the fleet's, over the window
    incarnation_causes: dict[str, int]
    reconnects: int
    first_audit: Audit
    audit: Audit


@dataclass(frozen=True, slots=True)
class RestartFigures:
    healthy_s: float  # from the start of the restarted router to its /healthz
    on_index_s: float  # ... to its /fleet/locality finding a system prompt's holders
    resumed: int  # streams that went on under the same incarnation (another router's)
    new_incarnations: int
    incarnation_causes: dict[str, int]
    reconnects: int
    requests: int
    failed_requests: int  # those sent to the dead router included
    first_audit: Audit
    audit: Audit


@dataclass(frozen=True, slots=True)
class FaultFigures:
    workers: int
    routers: int
    audit_before: Audit
    failover: FailoverFigures
    restart: RestartFigures


class _Load:
    """Requests at `rate` a second through every router for `window_s`, in a thread."""

    def __init__(self, urls: Sequence[str], shape: FleetShape, rate: float, window_s: float):
        self.outcome: tuple[int, int] = (0, 0)
        self._thread = threading.Thread(
            target=self._run, args=(list(urls), shape, rate, window_s), daemon=True
        )
        self._thread.start()

    def _run(self, urls: list[str], shape: FleetShape, rate: float, window_s: float) -> None:
        self.outcome = asyncio.run(open_loop(urls, shape, rate, window_s))

    def join(self) -> tuple[int, int]:
        self._thread.join()
        return self.outcome


class _RoutingWatch:
    """Each router's `/readyz` routing every POLL_S, in a thread, as (seconds since
    `started`, url, routing)."""

    def __init__(self, urls: Sequence[str], started: float) -> None:
        self.samples: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(urls), started), daemon=True)
        self._thread.start()

    def _run(self, urls: list[str], started: float) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                for url in urls:
                    try:
                        routing = http.get(url + "/readyz").json().get("routing", "?")
                    except (httpx.HTTPError, ValueError):
                        routing = "unanswered"
                    self.samples.append((time.monotonic() - started, url, routing))
                self._stop.wait(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cache_aware_share_after(self, start: float) -> float:
        tail = [routing for at, _, routing in self.samples if at >= start]
        return sum(r == "cache-aware" for r in tail) / len(tail) if tail else math.nan

    def load_only_spans(self) -> dict[str, tuple[float, float]]:
        """Per router that went load-only: when it first did, and when it routed on the
        index for good (the first cache-aware sample after its last load-only one; NaN
        if the window ended load-only)."""
        spans: dict[str, tuple[float, float]] = {}
        for at, url, routing in self.samples:
            if routing == "load-only":
                spans[url] = (spans.get(url, (at, math.nan))[0], math.nan)
            elif routing == "cache-aware" and url in spans and math.isnan(spans[url][1]):
                spans[url] = (spans[url][0], at)
        return spans


def _resyncs(point: RunningPoint, reason: str) -> float:
    total = 0.0
    for replica in point.replicas:
        text = httpx.get(replica.url + "/metrics", headers=HEADERS, timeout=30).text
        for line in text.splitlines():
            if line.startswith(f'kvplane_resyncs_total{{reason="{reason}"}}'):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _decision_buckets(point: RunningPoint) -> list[dict[str, Any]]:
    return [router.scrape() for router in point.routers]


def _ask(fleet: Connection, message: object, timeout_s: float = 180.0) -> Any:
    fleet.send(message)
    if not fleet.poll(timeout_s):
        raise TimeoutError(f"the synthetic fleet did not answer {message!r}")
    return fleet.recv()


def _audit(fleet: Connection, point: RunningPoint) -> tuple[Audit, Audit]:
    """Pause the fleet's batches, audit the index against its caches, resume: the first
    audit, and the last. A worker whose lease ran out while the machine was saturated
    may look settled to the first while its entries are gone: its agent hears so at
    its next renewal and resends them. So, while the audit finds a mismatch, it is taken
    again (up to AUDITS times, a lease apart): what the last one finds was lost for
    good."""
    fleet.send(PAUSE)
    time.sleep(SETTLE_S)
    first = last = _ask(fleet, (AUDIT, point.cluster.live_url(), point.layout))
    for _ in range(AUDITS - 1):
        if not last.mismatched_workers:
            break
        time.sleep(AUDIT_RETRY_S)
        last = _ask(fleet, (AUDIT, point.cluster.live_url(), point.layout))
    fleet.send(RESUME)
    return first, last


def _busiest_master(point: RunningPoint, shape: FleetShape) -> ClusterNode:
    """The master serving the most workers' hashes (their groups' slots)."""
    counts: dict[int, int] = {}
    masters = point.cluster.masters()
    for number in range(shape.workers):
        slot = key_slot(point.layout.worker(f"synthetic-{number:05d}"))
        for index, master in enumerate(masters):
            if master.serves(slot):
                counts[index] = counts.get(index, 0) + 1
                break
    return masters[max(counts, key=lambda index: counts[index])]


def _wait(what: str, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(POLL_S)


def _failover(
    point: RunningPoint, fleet: Connection, shape: FleetShape, request_rate: float, window_s: float
) -> FailoverFigures:
    victim = _busiest_master(point, shape)
    (replica,) = point.cluster.replicas_of(victim)
    urls = [r.url for r in point.replicas]
    before_report: FleetReport = _ask(fleet, REPORT)
    lost_before = _resyncs(point, "index_lost_writes")
    load = _Load(urls, shape, request_rate, WARM_S + window_s)
    time.sleep(WARM_S)
    scrapes_before = _decision_buckets(point)
    killed = time.monotonic()
    watch = _RoutingWatch(urls, killed)
    victim.process.kill()
    victim.process.wait()
    _wait(
        "the replica serves as master",
        lambda: replica.info("replication").get("role") == "master",
        FAILOVER_TIMEOUT_S,
    )
    promoted_s = time.monotonic() - killed
    point.cluster.wait_ok(FAILOVER_TIMEOUT_S)
    cluster_ok_s = time.monotonic() - killed
    answered, failed = load.join()
    watch.stop()
    scrapes_after = _decision_buckets(point)
    spans = watch.load_only_spans()
    index_back_s = max((back for _, back in spans.values()), default=0.0)
    after_report: FleetReport = _ask(fleet, REPORT)
    first_audit, audit = _audit(fleet, point)
    decisions = bucket_delta(scrapes_before, scrapes_after, "kvplane_decision_seconds_bucket")
    return FailoverFigures(
        promoted_s=round(promoted_s, 2),
        cluster_ok_s=round(cluster_ok_s, 2),
        routers_load_only=len(spans),
        load_only_s=round(min((went for went, _ in spans.values()), default=math.nan), 2),
        index_back_s=round(index_back_s, 2),
        back_after_failover_s=round(index_back_s - promoted_s, 2) if spans else 0.0,
        cache_aware_share_at_end=round(watch.cache_aware_share_after(window_s - TAIL_S), 3),
        requests=answered,
        failed_requests=failed,
        decision_p99_ms=round(bucket_quantile(decisions, 0.99) * 1000, 1),
        lost_write_resyncs=round(_resyncs(point, "index_lost_writes") - lost_before),
        new_incarnations=after_report.incarnations - before_report.incarnations,
        incarnation_causes=_causes(before_report, after_report),
        reconnects=after_report.reconnects - before_report.reconnects,
        first_audit=first_audit,
        audit=audit,
    )


def _causes(before: FleetReport, after: FleetReport) -> dict[str, int]:
    """Why the fleet started new incarnations between two reports, and how often."""
    causes = {
        cause: count - before.incarnation_causes.get(cause, 0)
        for cause, count in after.incarnation_causes.items()
    }
    return {cause: count for cause, count in causes.items() if count}


def _restart(
    point: RunningPoint, fleet: Connection, shape: FleetShape, request_rate: float, window_s: float
) -> RestartFigures:
    victim = point.replicas[0]
    before_report: FleetReport = _ask(fleet, REPORT)
    load = _Load([r.url for r in point.replicas], shape, request_rate, WARM_S + window_s)
    time.sleep(WARM_S)
    victim.kill()
    time.sleep(RESTART_DOWN_S)
    started = time.monotonic()
    victim.start(point.cluster.live_url())  # returns once /healthz answers
    healthy_s = time.monotonic() - started
    holders = math.ceil(shape.workers / shape.system_prompts)
    query = {"model": MODEL, "token_ids": shape.system_prompt(0)}

    def finds_holders() -> bool:
        try:
            answer = httpx.post(
                victim.url + "/fleet/locality", headers=HEADERS, json=query, timeout=10
            ).json()
        except (httpx.HTTPError, ValueError):
            return False
        matched = sum(1 for row in answer.get("workers", []) if row["cached_tokens"] > 0)
        return matched >= holders

    _wait("the restarted router finds a system prompt's holders", finds_holders, 60)
    on_index_s = time.monotonic() - started
    answered, failed = load.join()
    after_report: FleetReport = _ask(fleet, REPORT)
    first_audit, audit = _audit(fleet, point)
    return RestartFigures(
        healthy_s=round(healthy_s, 2),
        on_index_s=round(on_index_s, 2),
        resumed=after_report.resumed - before_report.resumed,
        new_incarnations=after_report.incarnations - before_report.incarnations,
        incarnation_causes=_causes(before_report, after_report),
        reconnects=after_report.reconnects - before_report.reconnects,
        requests=answered,
        failed_requests=failed,
        first_audit=first_audit,
        audit=audit,
    )


def measure_faults(
    workdir: Path,
    shape: FleetShape,
    routers: int,
    *,
    request_rate: float,
    window_s: float,
    layout: KeyLayout,
) -> FaultFigures:
    """Both faults at one point; `window_s`: the load's length from each fault on."""
    with running_point(workdir, routers, layout) as point:
        shape = dataclasses.replace(shape, base_url=point.engine_url)
        with fleet_process(shape, point.grpc_addresses) as fleet:
            await_message(fleet, FILLED, FILL_TIMEOUT_S)
            require_in_play(point, shape)
            fleet.send(STEADY)
            _, audit_before = _audit(fleet, point)
            failover = _failover(point, fleet, shape, request_rate, window_s)
            restart = _restart(point, fleet, shape, request_rate, window_s)
            report: FleetReport = _ask(fleet, STOP)
    for failure in report.failed:
        print(f"  a synthetic worker failed: {failure}", flush=True)
    return FaultFigures(shape.workers, routers, audit_before, failover, restart)


def _row(f: FaultFigures) -> dict[str, object]:
    failover, restart = f.failover, f.restart
    return {
        "workers": f.workers,
        "routers": f.routers,
        "promoted s": failover.promoted_s,
        "cluster ok s": failover.cluster_ok_s,
        "load-only routers": failover.routers_load_only,
        "index back s": failover.index_back_s,
        "back after failover s": failover.back_after_failover_s,
        "cache-aware at end": failover.cache_aware_share_at_end,
        "req ok/failed": f"{failover.requests}/{failover.failed_requests}",
        "decide p99 ms": failover.decision_p99_ms,
        "lost-write resyncs": failover.lost_write_resyncs,
        "new inc": failover.new_incarnations,
        "audit missing/extra": f"{failover.first_audit.missing}/{failover.first_audit.extra}",
        "after resends": f"{failover.audit.missing}/{failover.audit.extra}",
        "restart healthy s": restart.healthy_s,
        "on index s": restart.on_index_s,
        "resumed/new inc": f"{restart.resumed}/{restart.new_incarnations}",
        "restart req ok/failed": f"{restart.requests}/{restart.failed_requests}",
        "restart audit missing/extra": f"{restart.first_audit.missing}/{restart.first_audit.extra}",
        "restart after resends": f"{restart.audit.missing}/{restart.audit.extra}",
    }


def fault_table(results: Sequence[FaultFigures]) -> str:
    from simulations.reporting import format_table

    rows = [_row(figures) for figures in results]
    header = list(rows[0]) if rows else []
    return format_table([header, *[[str(row[name]) for name in header] for row in rows]])


def run_fault_benchmark(
    *,
    json_path: Path | None,
    shapes: Sequence[FleetShape],
    routers: Sequence[int],
    request_rate: float,
    window_s: float,
    layout: KeyLayout,
) -> int:
    results: list[FaultFigures] = []
    for shape, replicas in itertools.product(shapes, routers):
        with tempfile.TemporaryDirectory(prefix="kvplane-bench-faults-") as workdir:
            print(f"{shape.workers} workers, {replicas} routers: faults ...", flush=True)
            figures = measure_faults(
                Path(workdir),
                shape,
                replicas,
                request_rate=request_rate,
                window_s=window_s,
                layout=layout,
            )
        results.append(figures)
        print(fault_table([figures]), flush=True)
    print()
    print(fault_table(results))
    document = {
        "benchmark": "scale-faults",
        "machine": {"cpus": psutil.cpu_count(), "python": platform.python_version()},
        "shape": {
            "batches_per_s_per_worker": shapes[0].batches_per_s,
            "capacity_blocks": shapes[0].capacity_blocks,
            "request_blocks": shapes[0].request_blocks,
            "requests_per_s": request_rate,
            "restart_down_s": RESTART_DOWN_S,
            "window_s": window_s,
            "index_groups": layout.groups,
            "index_directory": layout.directory,
        },
        "points": [asdict(figures) for figures in results],
    }
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=2) + "\n")
    return 0
