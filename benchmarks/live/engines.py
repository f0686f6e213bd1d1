"""The engines of one bake-off cell: engine simulators as real processes on loopback,
each publishing vLLM's KV events on ZMQ, and what the report reads from them.

Small KV caches, so that placement matters; the simulator's default timing model, so
that a cache miss costs prefill time as it would on a GPU.
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


@dataclass(frozen=True, slots=True)
class EngineShape:
    engines: int = 4
    # 8,192 tokens each: three or four 2,048-token system prompts with their questions,
    # so the fleet holds about fourteen: `shared-8` fits only where routing keeps each
    # prompt on one or two engines.
    kv_blocks: int = 512
    max_num_seqs: int = 16
    time_scale: float | None = None  # the simulator's own (None: real time); 0: at once


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    child: Child
    base_url: str
    events_endpoint: str  # where it publishes, for subscribers: tcp://127.0.0.1:PORT
    replay_endpoint: str


@dataclass(slots=True)
class EngineTotals:
    """Counters summed over an engine's lives (a restart sets them back to zero)."""

    queried_tokens: float = 0.0
    hit_tokens: float = 0.0
    requests: float = 0.0
    preemptions: float = 0.0

    def add(self, other: EngineTotals) -> None:
        self.queried_tokens += other.queried_tokens
        self.hit_tokens += other.hit_tokens
        self.requests += other.requests
        self.preemptions += other.preemptions

    def since(self, before: EngineTotals) -> EngineTotals:
        """What was counted after `before` was read."""
        return EngineTotals(
            self.queried_tokens - before.queried_tokens,
            self.hit_tokens - before.hit_tokens,
            self.requests - before.requests,
            self.preemptions - before.preemptions,
        )


@dataclass(slots=True)
class RunningEngines:
    engines: list[Engine]
    children: Children
    banked: dict[str, EngineTotals] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [engine.base_url for engine in self.engines]

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
        name = f"engine-{number}"
        engines.append(
            Engine(
                name,
                children.launch(name, command),
                f"http://127.0.0.1:{port}",
                f"tcp://127.0.0.1:{events}",
                f"tcp://127.0.0.1:{replay}",
            )
        )
    wait_ready((engine.child, engine.base_url + "/health") for engine in engines)
    return RunningEngines(engines, children)


def scrape(base_url: str) -> EngineTotals:
    """The engine's vLLM counters that the report uses."""
    text = httpx2.get(f"{base_url}/metrics", timeout=5).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return EngineTotals(
        queried_tokens=values.get("vllm:prefix_cache_queries_total", 0.0),
        hit_tokens=values.get("vllm:prefix_cache_hits_total", 0.0),
        requests=values.get("vllm:e2e_request_latency_seconds_count", 0.0),
        preemptions=values.get("vllm:num_preemptions_total", 0.0),
    )


def hit_rate(totals: Sequence[EngineTotals]) -> float:
    queried = sum(total.queried_tokens for total in totals)
    return sum(total.hit_tokens for total in totals) / queried if queried else 0.0
