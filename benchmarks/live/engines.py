"""The engines of one bake-off cell: engine simulators as real processes on loopback,
each publishing vLLM's KV events on ZMQ, and what the report reads from them.

Small KV caches, so that placement matters; the simulator's default timing model, so
that a cache miss costs prefill time as it would on a GPU.

A disaggregated fleet (`EngineShape.prefill_engines`) gives every engine vLLM's
NixlConnector as `kv_both` (as NixlConnector deployments do) and names the pools by
role: the first engines take prefill legs, the others decode legs. Or the same four
engines every one `kv_both` and no pool named (`EngineShape.kv_both`, the `pd-both`
fleet): any engine takes a whole request or either leg. The report reads,
besides the prefix cache's counters, where each engine's prompt tokens came from
(`vllm:prompt_tokens_by_source`): computed, hit in its own cache, or pulled.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.live.processes import Child, Children, wait_ready
from kvplane.core.serving import free_port

MODEL = "kvplane-tiny"
BLOCK_SIZE = 16
UNSALTED_SCOPE = "/"  # the simulator's cache scope of requests without a cache_salt
# vLLM's NixlConnector as NixlConnector deployments configure it: every engine kv_both,
# the pools named by role where a router needs them (kvplane's agents, vllm-router's
# --prefill/--decode).
PD_KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# vLLM's `vllm:prompt_tokens_by_source{source}`: where an engine's prompt tokens came
# from. Prefill work is `local_compute`; `external_kv_transfer` is what a decode engine
# pulled from a prefill engine instead of computing it.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
LOCAL_COMPUTE, LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER = (
    "local_compute",
    "local_cache_hit",
    "external_kv_transfer",
)
# The kinds of fleet a cell runs on (`CellResult.fleet`): no connector; two prefill and
# two decode engines; four engines each taking either leg or a whole request.
FLEET_AGGREGATED, FLEET_PD, FLEET_BOTH = "aggregated", "pd", "pd-both"
FLEET_LABELS = {
    FLEET_AGGREGATED: "4 engines, no connector",
    FLEET_PD: "2 prefill + 2 decode",
    FLEET_BOTH: "4 kv_both, role both",
}


@dataclass(frozen=True, slots=True)
class EngineShape:
    engines: int = 4
    # 8,192 tokens each: three or four 2,048-token system prompts with their questions,
    # so the fleet holds about fourteen: `shared-8` fits only where routing keeps each
    # prompt on one or two engines.
    kv_blocks: int = 512
    max_num_seqs: int = 16
    time_scale: float | None = None  # the simulator's own (None: real time); 0: at once
    # A disaggregated fleet: the first `prefill_engines` engines take prefill legs, the
    # others decode legs, every one with NixlConnector (kv_both). 0: an aggregated fleet,
    # no connector.
    prefill_engines: int = 0
    # Every engine with NixlConnector (kv_both) and no pool named: each takes a whole
    # request or either leg (kvplane's agents `--role both`). Moot with prefill_engines.
    kv_both: bool = False
    # A CPU tier of this many blocks on every engine (vLLM's native CPU offloading:
    # blocks written to host memory as they are computed, restored on a hit); 0: none.
    cpu_offload_blocks: int = 0
    # vLLM's `--scheduling-policy priority`: waiting requests run by the priority the
    # router sends (a router that sends none leaves it first come, first served).
    priority_scheduling: bool = False

    @property
    def disaggregated(self) -> bool:
        """Split into prefill and decode pools."""
        return self.prefill_engines > 0

    @property
    def connector(self) -> bool:
        """Every engine has NixlConnector (kv_both): pools or not, requests can split."""
        return self.disaggregated or self.kv_both

    @property
    def fleet(self) -> str:
        """`FLEET_PD`, `FLEET_BOTH` or `FLEET_AGGREGATED`."""
        if self.disaggregated:
            return FLEET_PD
        return FLEET_BOTH if self.kv_both else FLEET_AGGREGATED

    def role(self, number: int) -> str:
        """The role of the engine numbered `number` (from 1): prefill, decode or both."""
        if not self.disaggregated:
            return "both"
        return "prefill" if number <= self.prefill_engines else "decode"

    def engine_name(self, number: int) -> str:
        """`engine-N` in an aggregated fleet; `prefill-N` and `decode-N` (each pool
        numbered from 1) in a disaggregated one."""
        if not self.disaggregated:
            return f"engine-{number}"
        if number <= self.prefill_engines:
            return f"prefill-{number}"
        return f"decode-{number - self.prefill_engines}"


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    child: Child
    base_url: str
    events_endpoint: str  # where it publishes, for subscribers: tcp://127.0.0.1:PORT
    replay_endpoint: str
    role: str = "both"  # prefill, decode (a disaggregated fleet's pools) or both
    connector: bool = False  # NixlConnector (kv_both): it can take either leg of a split
    priority_scheduling: bool = False  # vLLM's `--scheduling-policy priority`


@dataclass(slots=True)
class EngineTotals:
    """Counters summed over an engine's lives (a restart sets them back to zero)."""

    queried_tokens: float = 0.0
    hit_tokens: float = 0.0
    requests: float = 0.0
    preemptions: float = 0.0
    # Hits a KV connector loaded past the device's (`vllm:external_prefix_cache_hits`):
    # a CPU tier's, or the tokens a decode engine pulled.
    external_hit_tokens: float = 0.0
    # Prompt tokens by where they came from (`vllm:prompt_tokens_by_source`): the source
    # names vLLM's (local_compute, local_cache_hit, external_kv_transfer). Empty where
    # the engine does not export them.
    prompt_tokens_by_source: dict[str, float] = field(default_factory=dict)

    def add(self, other: EngineTotals) -> None:
        self.queried_tokens += other.queried_tokens
        self.hit_tokens += other.hit_tokens
        self.requests += other.requests
        self.preemptions += other.preemptions
        self.external_hit_tokens += other.external_hit_tokens
        for source, tokens in other.prompt_tokens_by_source.items():
            self.prompt_tokens_by_source[source] = (
                self.prompt_tokens_by_source.get(source, 0.0) + tokens
            )

    def since(self, before: EngineTotals) -> EngineTotals:
        """What was counted after `before` was read."""
        return EngineTotals(
            self.queried_tokens - before.queried_tokens,
            self.hit_tokens - before.hit_tokens,
            self.requests - before.requests,
            self.preemptions - before.preemptions,
            self.external_hit_tokens - before.external_hit_tokens,
            {
                source: tokens - before.prompt_tokens_by_source.get(source, 0.0)
                for source, tokens in self.prompt_tokens_by_source.items()
            },
        )

    @property
    def computed_tokens(self) -> float:
        """Prompt tokens the engine computed: its prefill work."""
        return self.prompt_tokens_by_source.get(LOCAL_COMPUTE, 0.0)

    @property
    def pulled_tokens(self) -> float:
        """Prompt tokens the engine pulled from another engine (P/D's decode side)."""
        return self.prompt_tokens_by_source.get(EXTERNAL_KV_TRANSFER, 0.0)


@dataclass(frozen=True, slots=True)
class FleetBlocks:
    """What the fleet's caches hold, in blocks: every copy (`held`) and the distinct
    prefixes among them, on the devices and in the CPU tiers (0 without one)."""

    held: int
    distinct: int
    host_held: int
    host_distinct: int
    distinct_any_tier: int  # a block on a device and in host memory counted once


@dataclass(slots=True)
class RunningEngines:
    engines: list[Engine]
    children: Children
    banked: dict[str, EngineTotals] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [engine.base_url for engine in self.engines]

    def of_role(self, role: str) -> list[Engine]:
        return [engine for engine in self.engines if engine.role == role]

    def restart(self, index: int) -> None:
        """An engine restarted in place: its cache and counters are gone, nothing is
        announced (a new process sends no events). Its counters are banked first."""
        engine = self.engines[index]
        self.banked.setdefault(engine.name, EngineTotals()).add(scrape(engine.base_url))
        response = httpx2.post(f"{engine.base_url}/sim/faults", json={"restart": True}, timeout=5)
        response.raise_for_status()

    def totals(self) -> dict[str, EngineTotals]:
        """Every engine's counters since the cell started."""
        result = {}
        for engine in self.engines:
            totals = scrape(engine.base_url)
            totals.add(self.banked.get(engine.name, EngineTotals()))
            result[engine.name] = totals
        return result

    def cache_scopes(self) -> Counter[str]:
        """Cached blocks per cache scope (`/` is the unsalted one), over every engine: a
        multi-tenant workload whose blocks land in `/` lost its tenants' salts on the way."""
        scopes: Counter[str] = Counter()
        for engine in self.engines:
            body = httpx2.get(f"{engine.base_url}/sim/blocks", timeout=5).json()
            scopes.update(block["scope"] for block in body["blocks"])
        return scopes

    def fleet_blocks(self) -> FleetBlocks:
        """The blocks the engines' caches hold now, on the device and in a CPU tier:
        every copy, and the distinct ones (a block held by two engines, or on the device
        and in host memory, counts once), over every engine."""
        device: set[tuple[str, int]] = set()
        host: set[tuple[str, int]] = set()
        device_held = host_held = 0
        for engine in self.engines:
            body = httpx2.get(f"{engine.base_url}/sim/blocks", timeout=5).json()
            device_held += len(body["blocks"])
            host_held += len(body.get("host_blocks", ()))
            device.update((block["scope"], block["hash"]) for block in body["blocks"])
            host.update((block["scope"], block["hash"]) for block in body.get("host_blocks", ()))
        return FleetBlocks(device_held, len(device), host_held, len(host), len(device | host))

    def unsalted_blocks(self) -> set[tuple[str, str]]:
        """The blocks cached in the unsalted scope now, as (engine, block hash)."""
        found: set[tuple[str, str]] = set()
        for engine in self.engines:
            body = httpx2.get(f"{engine.base_url}/sim/blocks", timeout=5).json()
            found.update(
                (engine.name, block["hash"])
                for block in body["blocks"]
                if block["scope"] == UNSALTED_SCOPE
            )
        return found


def start_engines(children: Children, shape: EngineShape) -> RunningEngines:
    """Start every engine at once and wait until all answer `/health`."""
    engines = []
    for number in range(1, shape.engines + 1):
        port, events, replay = free_port(), free_port(), free_port()
        # vLLM binds only a wildcard endpoint (and connects to any other), so the engines
        # bind every interface, as in a real deployment; subscribers dial loopback.
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        command = [
            sys.executable, "-m", "kvplane.cli", "engine-sim",
            "--port", str(port),
            "--model", MODEL,
            "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(shape.kv_blocks),
            "--max-num-seqs", str(shape.max_num_seqs),
            "--kv-events-config", json.dumps(kv_events),
            # vLLM's render endpoints (off by default in vLLM too): vllm-router's prefix
            # policies take their token ids from them, and route on load alone without.
            "--enable-scale-out",
            "--log-level", "WARNING",
        ]  # fmt: skip
        if shape.time_scale is not None:
            command += ["--time-scale", str(shape.time_scale)]
        if shape.priority_scheduling:
            command += ["--scheduling-policy", "priority"]
        if shape.cpu_offload_blocks:
            # The offloading model's default copy bandwidth (about PCIe 4.0 x16).
            command += ["--cpu-offload-blocks", str(shape.cpu_offload_blocks)]
        if shape.connector:
            # The transfer model's defaults: an 8B model's KV (128 KiB a token) over a
            # 25 GB/s link, vLLM's 30 s lease.
            command += ["--kv-transfer-config", json.dumps(PD_KV_TRANSFER_CONFIG)]
        name = shape.engine_name(number)
        engines.append(
            Engine(
                name,
                children.launch(name, command),
                f"http://127.0.0.1:{port}",
                f"tcp://127.0.0.1:{events}",
                f"tcp://127.0.0.1:{replay}",
                shape.role(number),
                shape.connector,
                shape.priority_scheduling,
            )
        )
    wait_ready((engine.child, engine.base_url + "/health") for engine in engines)
    return RunningEngines(engines, children)


def scrape(base_url: str) -> EngineTotals:
    """The engine's vLLM counters that the report uses."""
    return parse_totals(httpx2.get(f"{base_url}/metrics", timeout=5).text)


def parse_totals(text: str) -> EngineTotals:
    """The counters the report uses, from an engine's Prometheus text."""
    values: dict[str, float] = {}
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name == PROMPT_TOKENS_BY_SOURCE + "_total":
                source = sample.labels.get("source", "")
                by_source[source] = by_source.get(source, 0.0) + sample.value
    return EngineTotals(
        queried_tokens=values.get("vllm:prefix_cache_queries_total", 0.0),
        hit_tokens=values.get("vllm:prefix_cache_hits_total", 0.0),
        requests=values.get("vllm:e2e_request_latency_seconds_count", 0.0),
        preemptions=values.get("vllm:num_preemptions_total", 0.0),
        external_hit_tokens=values.get("vllm:external_prefix_cache_hits_total", 0.0),
        prompt_tokens_by_source=by_source,
    )


def hit_rate(totals: Sequence[EngineTotals], *, external: bool = False) -> float:
    """Hit over queried tokens of the engines' prefix caches; with `external`, the hits
    a KV connector loaded count too (a CPU tier's: hits on either tier)."""
    queried = sum(total.queried_tokens for total in totals)
    hits = sum(
        total.hit_tokens + (total.external_hit_tokens if external else 0.0) for total in totals
    )
    return hits / queried if queried else 0.0
