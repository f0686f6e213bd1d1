"""`kvplane engine-sim`: the engine loop, the KV event publisher and HTTP in one process.

running_engine_sim() starts everything and yields what tests need (the bound HTTP port,
the ZMQ endpoints, the engine itself); serve_engine_sim() runs it until SIGINT or
SIGTERM. SIGUSR1 kills the process at once, like a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvplane.core.serving import bind_http, cancel_task, serving_http, wait_for_stop_signal
from kvplane.core.tokenizer import load_tokenizer
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.engine import SimEngine
from simulations.engine_sim.kv_events import EventEncoder, use_int_hashes
from simulations.engine_sim.kv_transfer import PullClient
from simulations.engine_sim.metrics import EngineMetrics
from simulations.engine_sim.publisher import EventPublisher
from simulations.engine_sim.server import create_engine_app, die_now

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunningEngineSim:
    http_port: int
    events_endpoint: str | None
    replay_endpoint: str | None
    engine: SimEngine

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def cache_config_labels(config: EngineSimConfig) -> dict[str, str]:
    """`vllm:cache_config_info` labels, named as vLLM's CacheConfig fields."""
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(config.num_blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
        "num_cpu_blocks": "0",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "prefix_caching_hash_algo": "sha256",
        "cache_dtype": "auto",
        "kv_offloading_size": str(config.kv_offloading_size),
        "kv_offloading_backend": config.kv_offloading_backend,
    }


@contextlib.asynccontextmanager
async def running_engine_sim(config: EngineSimConfig) -> AsyncIterator[RunningEngineSim]:
    tokenizer = load_tokenizer(config.tokenizer)
    metrics = EngineMetrics(
        config.model_names[0],
        cache_config_labels(config),
        kv_connector=config.kv_connector,
        kv_role=config.kv_role,
    )
    async with contextlib.AsyncExitStack() as stack:
        publisher = None
        events = config.kv_events_config
        if events.publishing:
            encoder = EventEncoder(config.kv_events_format, int_hashes=use_int_hashes())
            publisher = EventPublisher(
                events, encoder, drop_fraction=config.drop_event_fraction, seed=config.seed
            )
            stack.push_async_callback(publisher.close)
            publisher.start()
        engine = SimEngine(config, tokenizer.plain_token_ids(), metrics, publisher)
        stack.push_async_callback(cancel_task, asyncio.create_task(engine.run()))
        pull_client = None
        if config.pd:
            pull_client = PullClient()
            stack.push_async_callback(pull_client.close)
        app = create_engine_app(engine, tokenizer, config, pull_client=pull_client)
        (http_port,) = await stack.enter_async_context(
            serving_http((app, bind_http(config.host, config.port)))
        )
        yield RunningEngineSim(
            http_port=http_port,
            events_endpoint=None if publisher is None else publisher.endpoint,
            replay_endpoint=None if publisher is None else publisher.replay_endpoint,
            engine=engine,
        )


async def serve_engine_sim(config: EngineSimConfig) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, die_now)
    async with running_engine_sim(config) as running:
        offloading = config.cpu_offloading
        log.info(
            "engine simulator serving %s on %s:%d (%d blocks of %d tokens, %d on the CPU), "
            "KV events %s, KV transfer %s",
            ", ".join(config.model_names),
            config.host,
            running.http_port,
            config.num_blocks,
            config.block_size,
            0 if offloading is None else offloading.num_blocks,
            running.events_endpoint or "off",
            config.kv_role if config.pd else "off",
        )
        await wait_for_stop_signal()
        log.info("stopping")
