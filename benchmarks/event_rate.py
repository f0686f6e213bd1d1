"""`kvplane bench event-rate`: the KV events one busy engine announces, per second and per
request, and what a fleet of such engines sends its control plane.

One engine simulator with its default timing model (time scale 1: prefill and decode
take the time the model gives them) and KV events on; `concurrency` clients in a closed
loop of prompts of `prompt_tokens` token ids, of which the first `system_prompt_tokens`
are one of `system_prompts` shared system prompts and the rest new, each asking for
`max_tokens`. Its ZMQ events are decoded with the agent's own vLLM decoder
(worker_agent/engines/vllm.py) over `seconds`, after `warm_up_s` (the cache fills and
starts evicting first, as a busy engine's does). Counted: event batches (ZMQ messages),
stored and removed events and blocks, and requests answered.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
import zmq
import zmq.asyncio

from kvplane.core.serving import free_port
from simulations.engine_sim.process import spawn_engine_sim
from simulations.synthetic_fleet import TOKEN_IDS
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import EngineBlocksRemoved, EngineBlocksStored, EngineCacheCleared


@dataclass(slots=True)
class EventCounts:
    batches: int = 0
    stored_events: int = 0
    stored_blocks: int = 0
    removed_events: int = 0
    removed_blocks: int = 0
    cleared: int = 0

    def add(self, payload: bytes, adapter: VllmAdapter) -> None:
        self.batches += 1
        for event in adapter.decode_batch(payload).events:
            if isinstance(event, EngineBlocksStored):
                self.stored_events += 1
                self.stored_blocks += len(event.block_hashes)
            elif isinstance(event, EngineBlocksRemoved):
                self.removed_events += 1
                self.removed_blocks += len(event.block_hashes)
            elif isinstance(event, EngineCacheCleared):
                self.cleared += 1


@dataclass(frozen=True, slots=True)
class EventRateFigures:
    seconds: float
    requests: int
    requests_per_s: float
    batches_per_s: float
    events_per_s: float
    stored_blocks_per_s: float
    removed_blocks_per_s: float
    batches_per_request: float
    stored_events_per_request: float
    stored_blocks_per_request: float
    removed_blocks_per_request: float
    fleet_engines: int
    fleet_batches_per_s: float
    fleet_events_per_s: float
    fleet_block_changes_per_s: float


async def _closed_loop(
    base_url: str,
    concurrency: int,
    prompts: list[list[int]],
    question_tokens: int,
    max_tokens: int,
    until: float,
    answered: list[float],
) -> None:
    """Each client sends its next request as the last one ends, until `until`;
    `answered` gets each request's end time."""
    rng = random.Random("event-rate")

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            question = [rng.randrange(1, TOKEN_IDS) for _ in range(question_tokens)]
            body = {"prompt": rng.choice(prompts) + question, "max_tokens": max_tokens}
            response = await http.post(base_url + "/v1/completions", json=body)
            if response.status_code == 200:
                answered.append(time.monotonic())

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))


async def _measure(
    base_url: str,
    endpoint: str,
    *,
    seconds: float,
    warm_up_s: float,
    concurrency: int,
    prompts: list[list[int]],
    question_tokens: int,
    max_tokens: int,
) -> tuple[EventCounts, int, float]:
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    # A concrete address: the engine connects its publisher to it, as vLLM does (it
    # binds only a wildcard), and zmq retries until this end is bound.
    subscriber.bind(endpoint)
    adapter, counts = VllmAdapter(), EventCounts()
    answered: list[float] = []
    started = time.monotonic()
    window = (started + warm_up_s, started + warm_up_s + seconds)
    load = asyncio.ensure_future(
        _closed_loop(
            base_url, concurrency, prompts, question_tokens, max_tokens, window[1], answered
        )
    )
    try:
        while time.monotonic() < window[1]:
            try:
                async with asyncio.timeout(max(0.01, window[1] - time.monotonic())):
                    frames = await subscriber.recv_multipart()
            except TimeoutError:
                break
            if window[0] <= time.monotonic() and len(frames) == 3:
                counts.add(frames[2], adapter)
        await load
    finally:
        subscriber.close(linger=0)
        context.term()
    requests = sum(1 for at in answered if window[0] <= at <= window[1])
    return counts, requests, seconds


def run_event_rate_benchmark(
    *,
    json_path: Path | None,
    seconds: float,
    warm_up_s: float,
    concurrency: int,
    prompt_tokens: int,
    system_prompt_tokens: int,
    system_prompts: int,
    max_tokens: int,
    fleet_engines: int,
) -> int:
    rng = random.Random("system-prompts")
    prompts = [
        [rng.randrange(1, TOKEN_IDS) for _ in range(system_prompt_tokens)]
        for _ in range(system_prompts)
    ]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events_config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
    with spawn_engine_sim("--kv-events-config", events_config, "--log-level", "WARNING") as sim:
        counts, requests, span = asyncio.run(
            _measure(
                sim.base_url,
                endpoint,
                seconds=seconds,
                warm_up_s=warm_up_s,
                concurrency=concurrency,
                prompts=prompts,
                question_tokens=prompt_tokens - system_prompt_tokens,
                max_tokens=max_tokens,
            )
        )
    if requests == 0 or counts.batches == 0:
        print("no request was answered, or no event arrived, in the window: nothing measured")
        return 1
    events = counts.stored_events + counts.removed_events + counts.cleared
    figures = EventRateFigures(
        seconds=span,
        requests=requests,
        requests_per_s=round(requests / span, 2),
        batches_per_s=round(counts.batches / span, 2),
        events_per_s=round(events / span, 1),
        stored_blocks_per_s=round(counts.stored_blocks / span, 1),
        removed_blocks_per_s=round(counts.removed_blocks / span, 1),
        batches_per_request=round(counts.batches / requests, 2),
        stored_events_per_request=round(counts.stored_events / requests, 2),
        stored_blocks_per_request=round(counts.stored_blocks / requests, 1),
        removed_blocks_per_request=round(counts.removed_blocks / requests, 1),
        fleet_engines=fleet_engines,
        fleet_batches_per_s=round(counts.batches / span * fleet_engines),
        fleet_events_per_s=round(events / span * fleet_engines),
        fleet_block_changes_per_s=round(
            (counts.stored_blocks + counts.removed_blocks) / span * fleet_engines
        ),
    )
    for name, value in asdict(figures).items():
        print(f"{name:28} {value}")
    if json_path is not None:
        document = {
            "benchmark": "event-rate",
            "machine": {"cpus": psutil.cpu_count(), "python": platform.python_version()},
            "shape": {
                "concurrency": concurrency,
                "prompt_tokens": prompt_tokens,
                "system_prompt_tokens": system_prompt_tokens,
                "system_prompts": system_prompts,
                "max_tokens": max_tokens,
                "warm_up_s": warm_up_s,
            },
            "figures": asdict(figures),
        }
        json_path.write_text(json.dumps(document, indent=2) + "\n")
    return 0
