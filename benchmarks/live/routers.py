"""The routers of the bake-off: kvplane and the real peers, each started from its own
code in front of an `RunningEngines`.

Peers come from PyPI into an environment of their own (`make peers-env`), never the
product's dependencies; each is started with its documented command line, its own
defaults, and the policy under test. A router that cannot run here says why
(`RouterSpec.unavailable`) instead of vanishing from the table.

Every deployment reports evidence that what it measures was in play (`in_play`): for
kvplane, the workers registered and the index entries on each replica; for a peer that
reads engine events, what its metrics say it received.

Disaggregated fleets (the `pd` situation: prefill and decode engines, vLLM's
NixlConnector) get their own routers: kvplane with its agents naming each engine's
role (`--role prefill`/`decode`), splitting where it pays (`kvplane pd-conditional`,
its default) or always (`kvplane pd-always`), and vllm-router in its P/D mode
(`vllm-router pd-cache_aware`). And the same four engines with no pools (every one
`kv_both`, kvplane's agents `--role both`: any engine takes a whole request or either
leg), for a comparison on one fleet: kvplane splitting where it pays
(`kvplane both-conditional`), always (`kvplane both-always`), and never
(`kvplane both-never`, that fleet's aggregated reference). Their evidence says whether
P/D was in play: kvplane's split decisions and fallbacks, from its own metrics
(`pd_counters`).

Envoy (`make envoy-env`) stands in front of the engines twice: as the gateway that asks
kvplane's endpoint picker (`kvplane-envoy kvplane`: the routers as `kvplane kvplane`
starts them, each with `--picker-port`, and one Envoy per replica with
`kvplane envoy-config`'s bootstrap naming that replica's picker), and alone
(`envoy round_robin`: the same bootstrap less the picker), the floor for what the picker
adds to a request.

The `noisy-tenant` situation adds kvplane with flow control (`FLOW_ROUTERS`: one router,
and two replicas sharing its state in the cell's Redis), each tenant's share of a band
written into the tenants file where the workload configures one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import redis
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import trivial_picker
from benchmarks.live import envoy
from benchmarks.live.engines import (
    BLOCK_SIZE,
    FLEET_AGGREGATED,
    FLEET_BOTH,
    FLEET_PD,
    MODEL,
    Engine,
    RunningEngines,
)
from benchmarks.live.processes import Child, Children, Ready, StartFailed, wait_ready
from benchmarks.live.workloads import Workload
from kvplane.core.serving import free_port
from router.check import require_wiring
from router.lifecycle.flow import SCHEDULING_LABEL
from router.tenants import api_key_digest

# Where `make peers-env` builds the peers' environment; KVPLANE_PEERS_VENV points
# elsewhere.
_DEFAULT_PEERS_VENV = Path(__file__).resolve().parents[2] / ".peers-venv"
PEERS_BUILD_COMMAND = "make peers-env"
ENVOY_FAMILIES = frozenset({"kvplane-envoy", "envoy"})
ADMIN_TOKEN = "bench-live-admin"  # loopback only, for the fleet API's evidence
_ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def api_key(tenant: str) -> str:
    return f"sk-bench-{tenant}"


@dataclass(slots=True)
class Deployment:
    """A router running in front of the fleet: the URLs clients use (one per replica)
    and the processes whose CPU it is charged (agents included), each in a part of the
    deployment (`parts`, by process name: "router" unless named)."""

    urls: list[str]
    charged: list[Child]
    in_play: Callable[[], dict[str, Any]] = lambda: {}
    parts: dict[str, str] = field(default_factory=dict)
    # The router's own P/D counters summed over its replicas (kvplane's
    # kvplane_legs_decided_total and kvplane_disaggregation_fallbacks_total, by label),
    # read before and after the traffic; None for a router that has none.
    pd_counters: Callable[[], dict[str, float]] | None = None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each charged process, by name."""
        return {child.name: child.cpu_seconds() for child in self.charged}

    def by_part(self, by_process: dict[str, float]) -> dict[str, float]:
        """Figures by process name summed by part ("envoy", "router", "agents")."""
        totals: dict[str, float] = {}
        for name, value in by_process.items():
            part = self.parts.get(name, ROUTER_PART)
            totals[part] = totals.get(part, 0.0) + value
        return totals


ROUTER_PART, AGENTS_PART, ENVOY_PART = "router", "agents", "envoy"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    name: str  # as the table shows it: "family policy"
    family: str  # kvplane, smg, sglang-router, vllm-router
    policy: str
    start: Callable[[RouterSpec, RunningEngines, Children, int, Workload], Deployment] = field(
        compare=False, repr=False
    )
    # The fleet it stands in front of (`engines.FLEET_*`): the usual aggregated one, or,
    # in the `pd` situation only, prefill and decode pools (`pd`) or four engines that
    # each take either leg (`pd-both`).
    fleet: str = FLEET_AGGREGATED
    # Its fleet's aggregated reference: it never splits a request (`kvplane both-never`),
    # so P/D in play there is the anomaly.
    reference: bool = False
    # Replicas it runs as, the client alternating between them, whatever the situation
    # (the `two-replicas` situation runs every router as two).
    replicas: int = 1

    @property
    def disaggregated(self) -> bool:
        """In front of a fleet whose engines can split requests (the `pd` situation)."""
        return self.fleet != FLEET_AGGREGATED

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        if self.family == "kvplane":
            return None
        if self.family in ENVOY_FAMILIES:
            return envoy.unavailable()
        if not peers_python().exists():
            return f"the peers' environment {peers_venv()}/ is missing: run `{PEERS_BUILD_COMMAND}`"
        return None

    def version(self) -> str:
        if self.family == "kvplane":
            return importlib.metadata.version("kvplane")
        if self.family == "kvplane-envoy":
            return f"kvplane {importlib.metadata.version('kvplane')}, envoy {envoy.envoy_version()}"
        if self.family == "envoy":
            return envoy.envoy_version()
        return peer_version(self.family)


def peers_venv() -> Path:
    return Path(os.environ.get("KVPLANE_PEERS_VENV", _DEFAULT_PEERS_VENV))


def peers_python() -> Path:
    return peers_venv() / "bin" / "python"


@functools.cache  # a subprocess; the same answer for every cell of a run
def peer_version(distribution: str) -> str:
    completed = subprocess.run(
        [
            str(peers_python()),
            "-c",
            f"import importlib.metadata as m; print(m.version({distribution!r}))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return completed.stdout.strip() or "unknown"


# --- kvplane -------------------------------------------------------------------------

# kvplane's processes log warnings only, unless the bake-off's own environment names a
# level (KVPLANE_LOGGING__LEVEL=DEBUG with --logs keeps every routing decision).
_LOG_LEVEL = () if "KVPLANE_LOGGING__LEVEL" in os.environ else ("--log-level", "WARNING")


@dataclass(slots=True)
class KvplaneFleet:
    """kvplane's routers and agents, started: each replica's HTTP URL (and picker
    address, where asked), the processes, and the evidence of each replica."""

    urls: list[str]  # http://127.0.0.1:PORT, one a replica
    pickers: list[str]  # 127.0.0.1:PORT, one a replica; empty without the picker
    routers: list[Child]
    agents: list[Child]
    in_play: Callable[[], dict[str, Any]]

    @property
    def parts(self) -> dict[str, str]:
        return {
            **{child.name: ROUTER_PART for child in self.routers},
            **{child.name: AGENTS_PART for child in self.agents},
        }


def _start_kvplane(
    spec: RouterSpec, fleet: RunningEngines, children: Children, replicas: int, workload: Workload
) -> Deployment:
    tenants, shares = workload.tenants, workload.shares
    kvplane = launch_kvplane(
        spec.policy, fleet, children, replicas, tenants, picker=False, shares=shares
    )
    return Deployment(
        [url + "/v1" for url in kvplane.urls],
        [*kvplane.routers, *kvplane.agents],
        kvplane.in_play,
        kvplane.parts,
        pd_counters_of(kvplane.urls),
    )


# kvplane's P/D routers: the policy's name in the table, `[disaggregation] mode`. In
# front of the prefill and decode pools:
KVPLANE_PD_MODES = {"pd-conditional": "conditional", "pd-always": "always"}
# In front of four engines that each take either leg (`pd-both`); `never` is that
# fleet's aggregated reference.
KVPLANE_BOTH_MODES = {
    "both-conditional": "conditional",
    "both-always": "always",
    "both-never": "never",
}


# kvplane with flow control (`[flow_control]`, docs/router.md "Flow control"): requests
# wait in the router while the engines are saturated, tenants sharing by token cost,
# and those it cannot start are shed (429). A request waits 10 s at most, not the
# default 60: the noisy-tenant situation's noisy tenant outruns the fleet for 40 of its
# 50 s, and its requests are shed while the cell runs (counted as shed) instead of
# waiting past the cell's end (`bakeoff.DRAIN_S`), where the client would cancel them.
FLOW_CONTROL_SETTINGS = {
    "KVPLANE_FLOW_CONTROL__ENABLED": "true",
    "KVPLANE_FLOW_CONTROL__MAX_WAIT_S": "10",
}

# kvplane crediting no hit on a slower tier (host memory's bandwidth 0: a hit there is
# worth nothing over recomputing), the reference that shows what its tier credit does.
NO_TIER_CREDIT_SETTINGS = {"KVPLANE_SCORING__HOST_BANDWIDTH_BYTES_PER_S": "0"}


def disaggregation_settings(mode: str) -> dict[str, str]:
    """The environment of kvplane's routers that sets `[disaggregation] mode`."""
    return {"KVPLANE_DISAGGREGATION__MODE": mode}


def _kvplane_starter(
    settings: dict[str, str],
) -> Callable[[RouterSpec, RunningEngines, Children, int, Workload], Deployment]:
    """kvplane (its own policy) with `settings` in its routers' environment: in front
    of a fleet that can split, splitting requests as `[disaggregation] mode` says
    (`disaggregation_settings`: `conditional`, the default, set all the same so that
    the cell's settings say it, `always` or `never`); without its tier credit; or with
    flow control."""

    def start(
        spec: RouterSpec,
        fleet: RunningEngines,
        children: Children,
        replicas: int,
        workload: Workload,
    ) -> Deployment:
        kvplane = launch_kvplane(
            "kvplane",
            fleet,
            children,
            replicas,
            workload.tenants,
            picker=False,
            settings=settings,
            shares=workload.shares,
        )
        return Deployment(
            [url + "/v1" for url in kvplane.urls],
            [*kvplane.routers, *kvplane.agents],
            kvplane.in_play,
            kvplane.parts,
            pd_counters_of(kvplane.urls),
        )

    return start


def launch_kvplane(
    policy: str,
    fleet: RunningEngines,
    children: Children,
    replicas: int,
    tenants: tuple[str, ...],
    *,
    picker: bool,
    settings: dict[str, str] | None = None,
    shares: dict[str, float] | None = None,
) -> KvplaneFleet:
    """kvplane's replicas (sharing a Redis of the cell's own when there are several) and
    an agent beside each engine, every worker registered with every replica and the
    fleet's wiring checked; with `picker`, each replica serves the endpoint picker too.
    `settings`: the routers' environment besides (KVPLANE_DISAGGREGATION__MODE...);
    `shares`: tenants' shares of a flow-control band (the others' are 1). In a fleet
    with a connector each agent names its engine's role (`kvplane_agent_argv`)."""
    env = {"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN, **(settings or {})}
    flags = ["--policy", policy, "--block-size", str(BLOCK_SIZE), *_LOG_LEVEL]
    if replicas > 1:
        flags += ["--index", "redis", "--redis-url", own_redis(children)]
    if tenants:
        flags += ["--tenants-file", str(tenants_file(tenants, children.log_dir, shares or {}))]
        env["KVPLANE_TENANTS__CACHE_SALT_SECRET"] = "bench-live"
    routers = []
    pickers = []
    for number in range(1, replicas + 1):
        http, grpc = free_port(), free_port()
        command = [
            sys.executable, "-m", "kvplane.cli", "router",
            "--http-host", "127.0.0.1", "--http-port", str(http),
            "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc),
            *flags,
        ]  # fmt: skip
        if picker:
            picker_port = free_port()
            command += ["--picker-host", "127.0.0.1", "--picker-port", str(picker_port)]
            pickers.append(f"127.0.0.1:{picker_port}")
        routers.append((children.launch(f"kvplane-router-{number}", command, env), http, grpc))
    wait_ready((child, f"http://127.0.0.1:{http}/readyz") for child, http, _ in routers)
    addresses = ",".join(f"127.0.0.1:{grpc}" for _, _, grpc in routers)
    agents = [
        children.launch(f"kvplane-agent-{engine.name}", kvplane_agent_argv(engine, addresses))
        for engine in fleet.engines
    ]
    urls = [f"http://127.0.0.1:{http}" for _, http, _ in routers]
    _wait_registered(urls, len(fleet.engines), [*[r[0] for r in routers], *agents])
    checked = {url: check_wiring(url) for url in urls}

    def in_play() -> dict[str, Any]:
        evidence = {}
        for url in urls:
            index = _admin_get(url, "/fleet/index")
            answer = _admin_get(url, "/fleet/workers")
            workers = answer["workers"]
            evidence[url] = {
                "wiring_checked_before": checked[url],
                "blind_workers_after": sum(bool(row["wiring"]["blind"]) for row in workers),
                "routing_after": {row["model"]: row["routing"] for row in answer["routing"]},
                "index_entries": index["entries"],
                # Locations over keys: above 1 where blocks sit on two tiers (a CPU
                # tier's copies) or on two workers.
                "index_keys": index["keys"],
                "live_workers": sum(row["state"] == "live" for row in workers),
                "suspect_workers": sum(bool(row["suspect"]) for row in workers),
                # How much tokenising its caches spared (identical prompts, pieces).
                "tokenisation": _metric_totals(url, _TOKENISATION_SERIES.__contains__),
                # What the agents streamed to it, since it started: the cost of sight.
                "events": _metric_totals(url, _EVENT_SERIES.__contains__),
                # Why it routed as it did, and whether the engines' caches bore it out.
                "routing": _metric_totals(url, _ROUTING_SERIES.__contains__),
                # How its requests ended: `ok` through the proxy, `handed_off` where the
                # picker named the engine and Envoy carried the request.
                "requests_by_outcome": requests_by_outcome(url),
                # Split or whole, and why; fallbacks; prefill legs (all since it
                # started): whether P/D was in play.
                "disaggregation": disaggregation_counters(url),
                "workers_by_role": dict(Counter(str(row.get("role")) for row in workers)),
                # The cache-loss funnel since it started: what was lost where, copies
                # and evictions among it.
                "funnel": _admin_get(url, "/fleet/funnel"),
                # How long each tenant's requests waited in flow control's queue here.
                FLOW_WAIT_EVIDENCE: flow_waits(url),
            }
        return evidence

    return KvplaneFleet(urls, pickers, [r[0] for r in routers], agents, in_play)


def kvplane_agent_argv(engine: Engine, addresses: str) -> list[str]:
    """The agent beside `engine`, streaming to the routers at `addresses` (gRPC,
    comma-separated). Beside an engine with a connector it names the engine's role
    (`--role prefill`, `decode`, or `both` where every engine takes either leg), as
    NixlConnector deployments must (every engine is kv_both); none without one."""
    command = [
        sys.executable, "-m", "kvplane.cli", "agent",
        "--worker-id", engine.name,
        "--engine-url", engine.base_url,
        "--kv-events-endpoint", engine.events_endpoint,
        "--kv-events-replay-endpoint", engine.replay_endpoint,
        "--control-plane-address", addresses,
        "--block-size", str(BLOCK_SIZE),
        *_LOG_LEVEL,
    ]  # fmt: skip
    if engine.connector or engine.role != "both":
        command += ["--role", engine.role]
    if engine.priority_scheduling:  # vLLM tells no one: its operator labels the agent
        command += ["--labels", json.dumps({SCHEDULING_LABEL: "priority"})]
    return command


_DISAGGREGATION_SERIES = {
    "kvplane_legs_decided_total": ("split", "reason"),
    "kvplane_disaggregation_fallbacks_total": ("reason",),
    "kvplane_prefill_legs_total": ("outcome",),
}


def disaggregation_counters(url: str) -> dict[str, float]:
    """One replica's P/D counters, by their labels: `kvplane_legs_decided_total{split,
    reason}`, `kvplane_disaggregation_fallbacks_total{reason}`,
    `kvplane_prefill_legs_total{outcome}`."""
    totals: dict[str, float] = {}
    for name, labels in _DISAGGREGATION_SERIES.items():
        found = _metric_totals(url, name.__eq__, labels=labels)
        if "metrics" in found:  # unreadable
            raise RuntimeError(f"{url}/metrics: {found['metrics']}")
        totals.update(found)
    return totals


def pd_counters_of(urls: Sequence[str]) -> Callable[[], dict[str, float]]:
    """kvplane's P/D counters summed over its replicas, for `Deployment.pd_counters`."""

    def read() -> dict[str, float]:
        totals: dict[str, float] = {}
        for url in urls:
            for name, value in disaggregation_counters(url).items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    return read


_TOKENISATION_SERIES = frozenset(
    {
        "kvplane_token_cache_lookups",
        "kvplane_prompt_piece_tokens",
        "kvplane_piecewise_tokenisation_checks",
        "kvplane_prompt_rests_total",
    }
)

_EVENT_SERIES = frozenset(
    {
        "kvplane_batches_applied_total",
        "kvplane_events_applied_total",
        "kvplane_blocks_applied_total",
    }
)


_ROUTING_SERIES = frozenset(
    {
        "kvplane_routing_decisions_total",
        "kvplane_predicted_cached_tokens_total",
        "kvplane_reported_cached_tokens_total",
        "kvplane_prediction_verdicts_total",
    }
)


FLOW_WAIT_EVIDENCE = "flow_wait"  # a replica's evidence of flow_waits, by this key
_FLOW_WAIT_SUM, _FLOW_WAIT_COUNT = (
    "kvplane_flow_wait_seconds_sum",
    "kvplane_flow_wait_seconds_count",
)


def flow_waits(url: str, token: str = ADMIN_TOKEN) -> dict[str, dict[str, float]]:
    """One replica's `kvplane_flow_wait_seconds` by tenant, over bands: the `seconds` its
    requests waited in flow control's queue, and how many `requests` waited there (let
    through, shed, or their client gone; one that found room at once never queued);
    empty where none did."""
    wanted = {_FLOW_WAIT_SUM, _FLOW_WAIT_COUNT}
    totals = _metric_totals(url, wanted.__contains__, ("tenant",), token)
    if "metrics" in totals:  # unreadable
        raise RuntimeError(f"{url}/metrics: {totals['metrics']}")
    waits: dict[str, dict[str, float]] = {}
    for name, value in totals.items():
        series, _, labels = name.partition("{")
        tenant = labels.partition("tenant=")[2].rstrip("}")
        figure = "seconds" if series == _FLOW_WAIT_SUM else "requests"
        waits.setdefault(tenant, {})[figure] = value
    return waits


def requests_by_outcome(url: str) -> dict[str, float]:
    """`kvplane_requests_total` of one replica, summed by `outcome` (over workers)."""
    totals = _metric_totals(url, "kvplane_requests_total".__eq__, labels=("outcome",))
    return {name.partition("outcome=")[2].rstrip("}"): value for name, value in totals.items()}


def _wait_registered(urls: list[str], engines: int, watched: list[Child]) -> None:
    """Until every replica lists every engine's worker live (the agents registered)."""
    deadline = time.monotonic() + 60
    while True:
        for child in watched:
            if child.process.poll() is not None:
                raise StartFailed(f"{child.name} exited:\n{child.log_tail()}")
        try:
            if all(
                sum(row["state"] == "live" for row in _admin_get(url, "/fleet/workers")["workers"])
                >= engines
                for url in urls
            ):
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise StartFailed("kvplane's agents did not register with every router in 60 s")
        time.sleep(0.1)


def check_wiring(url: str, token: str = ADMIN_TOKEN) -> dict[str, Any]:
    """`kvplane check` against one replica, for the evidence; BlindFleet if it failed."""
    verdict = require_wiring(url, token)
    probed = sum(any(c.name == "probe_index" for c in w.checks) for w in verdict.workers)
    return {"ok": verdict.ok, "workers_probed": probed}


def _admin_get(url: str, path: str) -> Any:
    response = httpx2.get(url + path, headers=_ADMIN_HEADERS, timeout=5)
    response.raise_for_status()
    return response.json()


def tenants_file(tenants: tuple[str, ...], directory: Path, shares: dict[str, float]) -> Path:
    """kvplane's tenants file: each tenant's API key, and its share where `shares` names
    one."""
    lines = []
    for tenant in tenants:
        lines += [
            "[[tenants]]",
            f'name = "{tenant}"',
            f'api_key_sha256 = ["{api_key_digest(api_key(tenant))}"]',
            *([f"share = {shares[tenant]!r}"] if tenant in shares else []),
            "",
        ]
    path = directory / "tenants.toml"
    path.write_text("\n".join(lines))
    return path


def own_redis(children: Children, timeout_s: float = 10.0) -> str:
    """A redis-server for this cell's router replicas alone, nothing kept on disk, gone
    with the cell: the machine's own Redis is never written to, nor flushed."""
    port = free_port()
    server = children.launch(
        "redis",
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no"],
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while server.process.poll() is None and time.monotonic() < deadline:
            try:
                if client.ping():
                    return url
            except (redis.ConnectionError, redis.TimeoutError):  # not up yet
                time.sleep(0.05)
    finally:
        client.close()
    raise StartFailed(f"redis-server did not answer on port {port}:\n{server.log_tail()}")


# --- Envoy ---------------------------------------------------------------------------


def _start_kvplane_envoy(
    spec: RouterSpec, fleet: RunningEngines, children: Children, replicas: int, workload: Workload
) -> Deployment:
    """kvplane's replicas as `kvplane kvplane` starts them, each serving the endpoint
    picker too, and one Envoy per replica asking that replica's picker, each listing
    every engine: clients use the Envoys as they use kvplane's replicas."""
    kvplane = launch_kvplane(spec.policy, fleet, children, replicas, workload.tenants, picker=True)
    endpoints = envoy.engine_endpoints(fleet.urls)
    envoys = [
        envoy.launch_envoy(children, f"envoy-{number}", endpoints, picker)
        for number, picker in enumerate(kvplane.pickers, 1)
    ]
    envoy.wait_envoys(envoys)

    def in_play() -> dict[str, Any]:
        evidence = kvplane.in_play()  # each replica's, `handed_off` its requests
        return {**evidence, **{running.url: running.evidence() for running in envoys}}

    return Deployment(
        [running.url + "/v1" for running in envoys],
        [*(running.child for running in envoys), *kvplane.routers, *kvplane.agents],
        in_play,
        {**{running.child.name: ENVOY_PART for running in envoys}, **kvplane.parts},
    )


def _start_envoy_alone(
    spec: RouterSpec, fleet: RunningEngines, children: Children, replicas: int, workload: Workload
) -> Deployment:
    """Envoy alone, round robin over the engines (`envoy.alone_bootstrap`), one a
    replica."""
    endpoints = envoy.engine_endpoints(fleet.urls)
    envoys = [
        envoy.launch_envoy(children, f"envoy-{number}", endpoints, None)
        for number in range(1, replicas + 1)
    ]
    envoy.wait_envoys(envoys)
    return Deployment(
        [running.url + "/v1" for running in envoys],
        [running.child for running in envoys],
        lambda: {running.url: running.evidence() for running in envoys},
        {running.child.name: ENVOY_PART for running in envoys},
    )


# --- peers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerCommand:
    """How one peer starts: its command line for a port and the fleet, its extra
    environment, and the path that answers 200 once it routes."""

    argv: Callable[[int, RunningEngines], list[str]]  # (HTTP port, fleet)
    env: Callable[[RunningEngines], dict[str, str]] = lambda fleet: {}
    # smg's and sglang-router's /readiness turns 200 once one worker is registered, and
    # a worker they could not reach is left out: wait until every engine is counted.
    ready_path: str = "/readiness"
    counts_workers: bool = True
    log_level: str = "warn"


def _peer_starter(
    command: PeerCommand,
) -> Callable[[RouterSpec, RunningEngines, Children, int, Workload], Deployment]:
    def start(
        spec: RouterSpec,
        fleet: RunningEngines,
        children: Children,
        replicas: int,
        workload: Workload,
    ) -> Deployment:
        launched = []
        for number in range(1, replicas + 1):
            port, metrics_port = free_port(), free_port()
            flags = peer_service_flags(metrics_port, command.log_level)
            argv = [*command.argv(port, fleet), *flags]
            child = children.launch(f"{spec.family}-{number}", argv, command.env(fleet))
            launched.append((child, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"))
        ready = peer_ready(len(fleet.engines) if command.counts_workers else None)
        wait_ready(((child, url + command.ready_path) for child, url, _ in launched), ready=ready)
        return Deployment(
            [url + "/v1" for _, url, _ in launched],
            [child for child, _, _ in launched],
            lambda: {url: _peer_metrics(metrics) for _, url, metrics in launched},
        )

    return start


def peer_service_flags(metrics_port: int, log_level: str = "warn") -> list[str]:
    """A peer's own flags: every peer here serves Prometheus metrics, on 0.0.0.0:29000
    unless told."""
    return [
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", log_level,
    ]  # fmt: skip


def peer_ready(workers: int | None) -> Ready:
    """A peer's readiness answer: 200, and with `workers`, that many counted healthy."""

    def ready(response: httpx2.Response) -> bool:
        if response.status_code != 200:
            return False
        return workers is None or response.json().get("healthy_workers") == workers

    return ready


# What a peer's metrics say about its cache-aware machinery (events received, token ids
# missing, tree sizes): the series whose names mention it, summed over their labels.
_EVIDENCE_WORDS = ("kv", "cache", "event", "token", "tree", "policy")


def _peer_metrics(metrics_url: str) -> dict[str, Any]:
    return _metric_totals(
        metrics_url,
        lambda name: (
            any(word in name for word in _EVIDENCE_WORDS)
            and not name.endswith(("_bucket", "_created"))
        ),
    )


def _metric_totals(
    metrics_url: str,
    keep: Callable[[str], bool],
    labels: Sequence[str] | None = None,
    token: str = ADMIN_TOKEN,
) -> dict[str, Any]:
    """The samples whose names `keep` picks, summed over every label but their own (or
    but `labels`, where given)."""
    try:
        # kvplane's /metrics on its client port needs the admin token; the peers' ignore it.
        headers = {"Authorization": f"Bearer {token}"}
        text = httpx2.get(metrics_url + "/metrics", headers=headers, timeout=5).text
    except httpx2.HTTPError as error:
        return {"metrics": f"unreadable: {type(error).__name__}"}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if keep(sample.name):
                label = ",".join(
                    f"{k}={v}"
                    for k, v in sorted(sample.labels.items())
                    if k != "le" and (labels is None or k in labels)
                )
                name = f"{sample.name}{{{label}}}" if label else sample.name
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def _smg_argv(policy: str) -> Callable[[int, RunningEngines], list[str]]:
    def argv(port: int, fleet: RunningEngines) -> list[str]:
        return [
            str(peers_python()), "-m", "smg", "launch",
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *fleet.urls,
            "--policy", policy,
        ]  # fmt: skip

    return argv


def _sglang_argv(policy: str) -> Callable[[int, RunningEngines], list[str]]:
    def argv(port: int, fleet: RunningEngines) -> list[str]:
        return sglang_router_argv(policy, port, fleet.urls)

    return argv


def sglang_router_argv(policy: str, port: int, worker_urls: Sequence[str]) -> list[str]:
    return [
        str(peers_python()), "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
    ]  # fmt: skip


def _vllm_router_argv(policy: str) -> Callable[[int, RunningEngines], list[str]]:
    def argv(port: int, fleet: RunningEngines) -> list[str]:
        command = [
            str(peers_venv() / "bin" / "vllm-router"),
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *fleet.urls,
            "--policy", policy,
            # It opens its port once a worker answers /health, checking every 30 s by
            # default; the engines are up already, but one early miss would cost 30 s.
            "--worker-startup-check-interval", "1",
        ]  # fmt: skip
        if policy == "kv_aware":
            for engine in fleet.engines:
                command += ["--kv-event-source", f"{engine.base_url}={engine.events_endpoint}"]
            command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
        return command

    return argv


def _vllm_router(policy: str) -> PeerCommand:
    # Its /readiness counts every configured worker healthy, reachable or not (it opens
    # its port only once one answers); it does not honour `--log-level warning`. Its
    # prefix policies take token ids from the engines' render endpoints over HTTP (a
    # tokenizer of its own, VLLM_ROUTER_TOKENIZER, changes nothing there).
    return PeerCommand(_vllm_router_argv(policy), counts_workers=False, log_level="error")


# vllm-router's P/D mode: the prefill pool by its cache-aware policy (token ids from the
# engines' render endpoints), the decode pool by power_of_two, as its own --help's P/D
# example pairs them ("PD mode with different policies for prefill and decode").
VLLM_ROUTER_PD_DECODE_POLICY = "power_of_two"


def vllm_router_pd_argv(
    prefill_policy: str,
    decode_policy: str,
    port: int,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
) -> list[str]:
    """vllm-router in vLLM P/D mode (NixlConnector's two legs, as vLLM's toy proxy):
    `--prefill URL` (no bootstrap port: NIXL pulls) and `--decode URL` per engine."""
    command = [
        str(peers_venv() / "bin" / "vllm-router"),
        "--host", "127.0.0.1", "--port", str(port),
        "--vllm-pd-disaggregation",
    ]  # fmt: skip
    for url in prefill_urls:
        command += ["--prefill", url]
    for url in decode_urls:
        command += ["--decode", url]
    return [
        *command,
        "--prefill-policy", prefill_policy,
        "--decode-policy", decode_policy,
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def _vllm_router_pd(prefill_policy: str) -> PeerCommand:
    def argv(port: int, fleet: RunningEngines) -> list[str]:
        return vllm_router_pd_argv(
            prefill_policy,
            VLLM_ROUTER_PD_DECODE_POLICY,
            port,
            [engine.base_url for engine in fleet.of_role("prefill")],
            [engine.base_url for engine in fleet.of_role("decode")],
        )

    return PeerCommand(argv, counts_workers=False, log_level="error")


def _kvplane(policy: str) -> RouterSpec:
    return RouterSpec(f"kvplane {policy}", "kvplane", policy, _start_kvplane)


def _start_envoy_trivial_picker(
    spec: RouterSpec, fleet: RunningEngines, children: Children, replicas: int, workload: Workload
) -> Deployment:
    """Envoy asking a picker that decides nothing (benchmarks/trivial_picker.py: the same
    protocol and gRPC server as kvplane's, round robin), one of each a replica: the
    floor under kvplane's picker, charged as the router."""
    endpoints = envoy.engine_endpoints(fleet.urls)
    pickers = []
    for number in range(1, replicas + 1):
        port = free_port()
        command = trivial_picker.command(port, endpoints)
        pickers.append((children.launch(f"trivial-picker-{number}", command), port))
    envoys = [
        envoy.launch_envoy(children, f"envoy-{number}", endpoints, f"127.0.0.1:{port}")
        for number, (_, port) in enumerate(pickers, 1)
    ]
    envoy.wait_envoys(envoys)  # which waits for the pickers' health too
    return Deployment(
        [running.url + "/v1" for running in envoys],
        [*(running.child for running in envoys), *(picker for picker, _ in pickers)],
        lambda: {running.url: running.evidence() for running in envoys},
        {running.child.name: ENVOY_PART for running in envoys},
    )


def _peer(family: str, policy: str, command: PeerCommand) -> RouterSpec:
    return RouterSpec(f"{family} {policy}", family, policy, _peer_starter(command))


ROUTERS: tuple[RouterSpec, ...] = (
    _kvplane("kvplane"),
    _kvplane("round-robin"),
    RouterSpec("kvplane-envoy kvplane", "kvplane-envoy", "kvplane", _start_kvplane_envoy),
    RouterSpec("envoy round_robin", "envoy", "round_robin", _start_envoy_alone),
    RouterSpec("envoy trivial-picker", "envoy", "trivial-picker", _start_envoy_trivial_picker),
    _peer("smg", "cache_aware", PeerCommand(_smg_argv("cache_aware"))),
    _peer("smg", "round_robin", PeerCommand(_smg_argv("round_robin"))),
    _peer("sglang-router", "cache_aware", PeerCommand(_sglang_argv("cache_aware"))),
    _peer("sglang-router", "round_robin", PeerCommand(_sglang_argv("round_robin"))),
    _peer("vllm-router", "cache_aware", _vllm_router("cache_aware")),
    _peer("vllm-router", "kv_aware", _vllm_router("kv_aware")),
    _peer("vllm-router", "round_robin", _vllm_router("round_robin")),
)

# The `pd` situation's routers, set against `kvplane kvplane` in front of an aggregated
# fleet with the same requests: in front of two prefill and two decode engines (kvplane
# splitting where it pays or always, vllm-router's P/D mode), and in front of four
# engines that each take either leg (kvplane splitting where it pays, always, never:
# the last that fleet's aggregated reference).
PD_ROUTERS: tuple[RouterSpec, ...] = (
    *(
        RouterSpec(
            f"kvplane {name}",
            "kvplane",
            name,
            _kvplane_starter(disaggregation_settings(mode)),
            FLEET_PD,
        )
        for name, mode in KVPLANE_PD_MODES.items()
    ),
    RouterSpec(
        "vllm-router pd-cache_aware",
        "vllm-router",
        "pd-cache_aware",
        _peer_starter(_vllm_router_pd("cache_aware")),
        FLEET_PD,
    ),
    *(
        RouterSpec(
            f"kvplane {name}",
            "kvplane",
            name,
            _kvplane_starter(disaggregation_settings(mode)),
            FLEET_BOTH,
            reference=mode == "never",
        )
        for name, mode in KVPLANE_BOTH_MODES.items()
    ),
)

# The `noisy-tenant` situation's own routers, beside kvplane without flow control and
# the cache-aware peers: kvplane with flow control, as one router and as two replicas
# sharing their index (and the flow's shared state) in the cell's Redis.
FLOW_ROUTERS: tuple[RouterSpec, ...] = (
    RouterSpec(
        "kvplane flow-control",
        "kvplane",
        "flow-control",
        _kvplane_starter(FLOW_CONTROL_SETTINGS),
    ),
    RouterSpec(
        "kvplane flow-control x2",
        "kvplane",
        "flow-control x2",
        _kvplane_starter(FLOW_CONTROL_SETTINGS),
        replicas=2,
    ),
)

# The `eviction-cpu` situation's extra router: kvplane without its tier credit, beside
# every router of `ROUTERS`, on the same engines with a CPU tier.
TIER_ROUTERS: tuple[RouterSpec, ...] = (
    RouterSpec(
        "kvplane no-tier-credit",
        "kvplane",
        "no-tier-credit",
        _kvplane_starter(NO_TIER_CREDIT_SETTINGS),
    ),
)
