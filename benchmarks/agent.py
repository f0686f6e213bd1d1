"""`kvplane bench agent`: how many stored blocks per second one agent decodes, translates
and forwards to a control plane, acknowledged.

Three processes, as in a fleet: an engine stand-in that publishes vLLM 0.32 event
batches on a ZMQ PUB socket as fast as ZMQ takes them (each batch what one engine step
announces: one BlockStored of `blocks_per_event` blocks of 16 tokens, half the chains
continuing an earlier one); the control plane (`kvplane router`, in-memory index); and
here the agent's pipeline: the event source (SUB), the vLLM adapter's decoder, the block
translator and the publisher over real gRPC. The clock runs from the first batch
received to the control plane's acknowledgement of the last.

A second figure leaves the network out: decode and translate only.

With `--rate`, the stand-in publishes that many batches a second instead, as an engine
does (a batch a step, each arriving alone), and the figure that matters is the agent's
CPU a batch (this process's CPU time, every thread), and the control plane's (the
router process's): a flood hides the fixed cost of each wake-up, receive and gRPC round
trip behind batches that arrive together.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import zmq

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.serving import cancel_task, free_port, run_service
from simulations.engine_sim.block_pool import BlocksStored as EngineStored
from simulations.engine_sim.kv_events import EventEncoder, WireFormat
from simulations.processes import spawn_kvplane
from worker_agent.agent import tune_garbage_collector
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.kv_event_source import KvEventSource, StateLost
from worker_agent.publisher import ControlPlanePublisher, WorkerIdentity
from worker_agent.translate import BlockTranslator

BLOCK_SIZE = 16


@dataclass(frozen=True)
class AgentFigures:
    stored_blocks: int
    blocks_per_event: int
    stored_blocks_per_s: float
    translate_only_blocks_per_s: float
    rate_per_s: float | None  # batches a second published; None: as fast as ZMQ takes them
    cpu_us_per_batch: float  # the agent's CPU (this process, every thread) a batch
    router_cpu_us_per_batch: float  # the control plane's (its process, every thread)


def engine_batches(events: int, blocks_per_event: int, seed: int) -> list[bytes]:
    """Encoded KV event batches of fresh blocks, as an engine would publish them."""
    generator = random.Random(seed)
    encoder = EventEncoder(WireFormat.VLLM_0_32)
    chain_ends: list[bytes] = []
    payloads = []
    for _ in range(events):
        parent = generator.choice(chain_ends) if chain_ends and generator.random() < 0.5 else None
        digests = tuple(generator.randbytes(32) for _ in range(blocks_per_event))
        tokens = tuple(generator.randrange(50_000) for _ in range(blocks_per_event * BLOCK_SIZE))
        stored = EngineStored(digests, parent, tokens, BLOCK_SIZE, None, (None,) * len(digests))
        payloads.append(encoder.encode_batch(time.time(), [stored]))
        chain_ends.append(digests[-1])
    return payloads


def _translate_only(payloads: list[bytes]) -> float:
    adapter, translator = VllmAdapter(), _translator()
    start = time.perf_counter()
    for payload in payloads:
        translator.translate(adapter.decode_batch(payload)[1])
    return time.perf_counter() - start


def _engine_publisher(
    payloads: list[bytes], endpoint: str, ready: Any, rate_per_s: float | None
) -> None:
    """The engine's side, in its own process: publish every batch, as fast as ZMQ takes
    them or `rate_per_s` a second, once the agent has subscribed."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, len(payloads) + 1)
    pub.bind(endpoint)
    ready.wait()
    time.sleep(0.5)  # the subscription reaching the PUB socket
    start = time.perf_counter()
    for sequence, payload in enumerate(payloads):
        if rate_per_s is not None:
            time.sleep(max(0.0, start + sequence / rate_per_s - time.perf_counter()))
        pub.send_multipart([b"", sequence.to_bytes(8, "big"), payload])
    time.sleep(5)  # let the last messages drain before the socket closes
    context.destroy(linger=0)


async def _forward(
    payloads: list[bytes], grpc_port: int, rate_per_s: float | None, router: psutil.Process
) -> tuple[float, float, float]:
    """The agent's side: SUB, decode, translate, publish over gRPC, until the control
    plane acknowledged the last batch. Seconds, the agent's CPU seconds and `router`'s,
    from the first batch received."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ready = multiprocessing.get_context("spawn").Event()
    engine = multiprocessing.get_context("spawn").Process(
        target=_engine_publisher, args=(payloads, endpoint, ready, rate_per_s), daemon=True
    )
    engine.start()
    translator = _translator()
    agent = AgentSettings(control_plane_address=f"127.0.0.1:{grpc_port}")
    publisher = ControlPlanePublisher(
        WorkerIdentity(
            "bench-worker", "http://127.0.0.1:1", "bench", BLOCK_SIZE, 0, "vllm", "", {}
        ),
        agent,
        ControlPlaneSettings(block_size=BLOCK_SIZE),
        snapshot=translator.snapshot,
    )
    # As `kvplane agent` reads them: a step's batch waits for the next ones.
    source = KvEventSource(
        VllmAdapter(), endpoint, replay_endpoint=None, gather_s=agent.batch_linger_s
    )
    task = asyncio.create_task(publisher.run())
    try:
        await publisher.wait_connected()
        ready.set()
        start = cpu_start = router_start = 0.0
        async for item in source.items():
            if isinstance(item, StateLost):
                raise RuntimeError(f"the benchmark lost batches: {item.reason}")
            if item.sequence == 0:
                start, cpu_start = time.perf_counter(), time.process_time()
                router_start = _cpu_seconds(router)
            publisher.submit(translator.translate(item.events))
            if item.sequence == len(payloads) - 1:
                break
        await publisher.wait_flushed()
        cpu_s, router_cpu_s = time.process_time() - cpu_start, _cpu_seconds(router) - router_start
        return time.perf_counter() - start, cpu_s, router_cpu_s
    finally:
        await cancel_task(task)
        source.close()
        engine.kill()


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _translator() -> BlockTranslator:
    return BlockTranslator("bench", BLOCK_SIZE, max_tracked_blocks=50_000_000)


def run_agent_benchmark(
    *,
    json_path: Path | None,
    events: int,
    blocks_per_event: int,
    rate_per_s: float | None = None,
    seed: int = 1,
) -> int:
    tune_garbage_collector()  # as `kvplane agent` does for its process
    payloads = engine_batches(events, blocks_per_event, seed)
    blocks = events * blocks_per_event
    translate_s = _translate_only(payloads)
    grpc_port, http_port = free_port(), free_port()
    args = ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    health_url = f"http://127.0.0.1:{http_port}/healthz"
    with spawn_kvplane([*args, "--log-level", "WARNING"], health_url) as router:
        forward = _forward(payloads, grpc_port, rate_per_s, psutil.Process(router.pid))
        forward_s, cpu_s, router_cpu_s = run_service(forward)
    figures = AgentFigures(
        stored_blocks=blocks,
        blocks_per_event=blocks_per_event,
        stored_blocks_per_s=round(blocks / forward_s),
        translate_only_blocks_per_s=round(blocks / translate_s),
        rate_per_s=rate_per_s,
        cpu_us_per_batch=round(cpu_s / events * 1e6, 1),
        router_cpu_us_per_batch=round(router_cpu_s / events * 1e6, 1),
    )
    arrival = "as fast as ZMQ takes them" if rate_per_s is None else f"{rate_per_s:g} a second"
    print(
        f"agent: {blocks:,} stored blocks ({blocks_per_event} per event, {arrival}): "
        f"{figures.stored_blocks_per_s:,.0f} blocks/s decoded, translated, forwarded and "
        f"acknowledged, {figures.cpu_us_per_batch:,.0f} µs of the agent's CPU a batch "
        f"and {figures.router_cpu_us_per_batch:,.0f} µs of the control plane's; "
        f"{figures.translate_only_blocks_per_s:,.0f} blocks/s decode and translate only"
    )
    if json_path is not None:
        report = {
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
            **asdict(figures),
        }
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0
