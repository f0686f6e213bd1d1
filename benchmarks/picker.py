"""`kvplane bench picker`: what the endpoint picker adds to a request, one at a time.

Every process real and apart (engine simulators answering at once, their agents, a
router serving its proxy and its picker, a trivial picker, Envoys), the same short
completions sent one after another along each route, and each route's latency and the
CPU its processes spent:

- `engine`: straight to an engine (the floor of the floor);
- `envoy alone`: Envoy round robin (`kvplane envoy-config`'s bootstrap less the picker);
- `envoy + trivial picker`: Envoy asking a picker that decides nothing
  (benchmarks/trivial_picker.py: the same protocol and gRPC server as kvplane's);
- `envoy + kvplane picker`: Envoy asking kvplane's picker;
- `kvplane proxy`: kvplane's own proxy.

The engines answer at once (`--time-scale 0`) and every prompt is new, so the routes
differ only by what stands between the client and the engine. One request at a time
shows the latency a request pays, not a queue's.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx2

from benchmarks import trivial_picker
from benchmarks.live.engines import MODEL, EngineShape, start_engines
from benchmarks.live.envoy import engine_endpoints, launch_envoy, unavailable, wait_envoys
from benchmarks.live.processes import Child, Children
from benchmarks.live.routers import launch_kvplane
from kvplane.core.serving import free_port
from simulations.reporting import percentile

ENGINES = 2


@dataclass(frozen=True, slots=True)
class RouteFigures:
    route: str
    requests: int
    latency_p50_ms: float
    latency_p90_ms: float
    added_p50_ms: float | None  # over Envoy alone's p50 (its own: over the engine's)
    cpu_ms_per_request: dict[str, float]  # by process: envoy, picker, router


def _latencies(client: httpx2.Client, url: str, requests: int) -> list[float]:
    """Seconds each of `requests` new short completions took, one at a time."""
    seconds = []
    for _ in range(requests):
        body = {"model": MODEL, "prompt": f"a new prompt {uuid.uuid4().hex} " * 4, "max_tokens": 1}
        started = time.perf_counter()
        response = client.post(url + "/v1/completions", json=body)
        seconds.append(time.perf_counter() - started)
        response.raise_for_status()
    return seconds


def run_picker_benchmark(*, json_path: Path | None, requests: int, repeats: int) -> int:
    why_not = unavailable()
    if why_not is not None:
        print(f"kvplane bench picker: {why_not}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-picker-") as work:
        children = Children(Path(work))
        try:
            figures = _measure(children, requests, repeats)
        finally:
            children.stop_all()
    _print(figures, requests, repeats)
    if json_path is not None:
        routes = [asdict(figure) for figure in figures]
        document = {"requests": requests, "repeats": repeats, "routes": routes}
        json_path.write_text(json.dumps(document, indent=2))
    return 0


def _measure(children: Children, requests: int, repeats: int) -> list[RouteFigures]:
    engines = start_engines(children, EngineShape(engines=ENGINES, time_scale=0.0))
    kvplane = launch_kvplane("kvplane", engines, children, 1, (), picker=True)
    (router,), (router_url,), (picker,) = kvplane.routers, kvplane.urls, kvplane.pickers
    endpoints = engine_endpoints(engines.urls)
    trivial_port = free_port()
    trivial = children.launch("trivial-picker", trivial_picker.command(trivial_port, endpoints))
    alone = launch_envoy(children, "envoy-alone", endpoints, None)
    trivially = launch_envoy(children, "envoy-trivial", endpoints, f"127.0.0.1:{trivial_port}")
    picked = launch_envoy(children, "envoy-kvplane", endpoints, picker)
    wait_envoys([alone, trivially, picked])  # each until its picker passes its checks
    # Each route, and the processes charged for it (the router's CPU counts its agents'
    # streams too, in the proxy's row and the picker's alike).
    routes: dict[str, tuple[str, dict[str, Child]]] = {
        "engine": (f"http://{endpoints[0]}", {}),
        "envoy alone": (alone.url, {"envoy": alone.child}),
        "envoy + trivial picker": (trivially.url, {"envoy": trivially.child, "picker": trivial}),
        "envoy + kvplane picker": (picked.url, {"envoy": picked.child, "router": router}),
        "kvplane proxy": (router_url, {"router": router}),
    }
    samples: dict[str, list[float]] = {route: [] for route in routes}
    cpu: dict[str, dict[str, float]] = {route: {} for route in routes}
    with httpx2.Client(timeout=30) as client:
        for url, _ in routes.values():
            _latencies(client, url, 20)  # each path's connections warm
        for _ in range(repeats):
            for route, (url, charged) in routes.items():
                before = {name: child.cpu_seconds() for name, child in charged.items()}
                samples[route] += _latencies(client, url, requests)
                for name, child in charged.items():
                    spent = child.cpu_seconds() - before[name]
                    cpu[route][name] = cpu[route].get(name, 0.0) + spent
    total = requests * repeats
    p50 = {route: statistics.median(values) for route, values in samples.items()}
    return [
        RouteFigures(
            route,
            total,
            1000 * p50[route],
            1000 * percentile(values, 0.9),
            None
            if route == "engine"
            else 1000 * (p50[route] - p50["engine" if route == "envoy alone" else "envoy alone"]),
            {name: 1000 * seconds / total for name, seconds in cpu[route].items()},
        )
        for route, values in samples.items()
    ]


def _print(figures: list[RouteFigures], requests: int, repeats: int) -> None:
    print(
        f"kvplane bench picker: {requests} new short completions x {repeats}, one at a "
        "time, along each route (engines answer at once)"
    )
    print(f"{'route':<24} {'p50 ms':>8} {'p90 ms':>8} {'added p50 ms':>13}  CPU ms/request")
    for figure in figures:
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in figure.cpu_ms_per_request.items())
        added = "" if figure.added_p50_ms is None else f"{figure.added_p50_ms:+.2f}"
        over = "  (added: over the engine)" if figure.route == "envoy alone" else ""
        print(
            f"{figure.route:<24} {figure.latency_p50_ms:>8.2f} {figure.latency_p90_ms:>8.2f} "
            f"{added:>13}  {parts}{over}"
        )
