"""CPU offloading as vLLM's OffloadingConnector does it: blocks written through to a CPU
tier as they are computed, evicted from it least recently used first, read back for a
request whose prefix the device lost; its hash-only events over real ZMQ, decoded by
the agent's own decoder."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.types import BlocksRemoved, BlocksStored, KvEvent, Tier
from simulations.engine_sim.app import RunningEngineSim
from simulations.engine_sim.block_hash import BlockHasher, none_hash, wire_hash
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.kv_events import EventEncoder, WireFormat
from simulations.engine_sim.offload import BlocksOffloaded
from tests.simulations.engine_sim.conftest import (
    decode_payload,
    engine_sim,
    metric,
    refused_at_start_up,
    replay,
)
from tests.waiting import wait_until
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.translate import BlockTranslator

BLOCK = 16
MODEL = "kvplane-tiny"
CORPUS = Path(__file__).parents[2] / "worker_agent" / "wire_corpus"
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
# Nothing but the copies takes time (with --time-scale 1).
NO_COMPUTE = {"prefill_ms_per_token": 0, "prefill_overhead_ms": 0, "decode_step_ms": 0}


def prompt(first: int, num_tokens: int) -> list[int]:
    """Token ids whose blocks no other first token's prompt shares."""
    return [first, *range(100, 100 + num_tokens - 1)]


def engine_hashes(tokens: list[int]) -> list[int]:
    """The engine's hashes of the prompt's full blocks, as its events send them."""
    hasher = BlockHasher(BLOCK, none_hash(), None, None)
    hasher.update(tokens)
    return [wire_hash(digest) for digest in hasher.digests]


@contextlib.asynccontextmanager
async def offloading_sim(
    **settings: Any,
) -> AsyncIterator[tuple[RunningEngineSim, httpx.AsyncClient]]:
    async with (
        engine_sim(**settings) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        yield sim, client


async def complete(client: httpx.AsyncClient, tokens: list[int], max_tokens: int = 1) -> int:
    """Run the prompt; its usage's cached tokens."""
    body = {"prompt": tokens, "max_tokens": max_tokens}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    details = response.json()["usage"]["prompt_tokens_details"]
    return 0 if details is None else int(details["cached_tokens"])


async def listing(client: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get("/sim/blocks")).json()
    return body


async def host_hashes(client: httpx.AsyncClient) -> set[int]:
    return {block["hash"] for block in (await listing(client))["host_blocks"]}


async def written(client: httpx.AsyncClient, tokens: list[int]) -> None:
    """Wait until the prompt's full blocks are on the CPU tier (writes are copies that
    end after the answer)."""

    async def on_cpu() -> bool:
        return set(engine_hashes(tokens)) <= await host_hashes(client)

    await wait_until("the prompt's blocks on the CPU", on_cpu)


async def cpu_events(sim: RunningEngineSim) -> list[dict[str, Any]]:
    """Every event on the CPU medium so far, from the replay buffer."""
    assert sim.replay_endpoint is not None
    batches = [decode_payload(frames[3]) for frames in (await replay(sim.replay_endpoint, 0))[:-1]]
    return [event for batch in batches for event in batch[1] if event.get("medium") == "CPU"]


async def test_prompt_blocks_are_written_through_as_they_are_computed() -> None:
    tokens = prompt(1, 4 * BLOCK + 6)
    async with offloading_sim(cpu_offload_blocks=32) as (sim, client):
        # 30 tokens of output fill two more blocks on the device, none on the CPU.
        await complete(client, tokens, max_tokens=30)
        await written(client, tokens)
        blocks = await listing(client)
        events = await cpu_events(sim)
        await client.post("/sim/faults", json={"restart": True})
        after_restart = await listing(client)
    device = {block["hash"]: block for block in blocks["blocks"]}
    assert len(device) == 6
    assert all(block["tier"] == "device" for block in device.values())
    host = blocks["host_blocks"]
    # Listed least recently used first: the request's tail, which goes first.
    assert [block["hash"] for block in host] == engine_hashes(tokens)[::-1]
    assert all(block["tier"] == "host" and block["scope"] == "/" for block in host)
    assert blocks["num_host_blocks"] == 32
    # vLLM 0.32's hash-only stores: one per block, no tokens, no parent, block size 0.
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [block_hash],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 0,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
            "group_idx": 0,
        }
        for block_hash in engine_hashes(tokens)
    ]
    assert after_restart["host_blocks"] == []  # a new process has an empty tier


async def test_decode_blocks_are_written_too_when_not_prompt_only() -> None:
    tokens = prompt(2, 4 * BLOCK + 6)
    extra = {"cpu_bytes_to_use": 64 * BLOCK * 4096, "offload_prompt_only": False}
    settings = {"kv_transfer_config": {**OFFLOADING, "kv_connector_extra_config": extra}}
    async with offloading_sim(kv_bytes_per_token=4096, **settings) as (_, client):
        await complete(client, tokens, max_tokens=30)
        device = {block["hash"] for block in (await listing(client))["blocks"]}

        async def all_on_cpu() -> bool:
            return await host_hashes(client) == device

        await wait_until("the output's blocks on the CPU", all_on_cpu)
        assert len(device) == 6
        assert (await listing(client))["num_host_blocks"] == 64


async def test_the_cpu_tier_evicts_its_least_recently_used_blocks_tail_first() -> None:
    a, b, c, d = (prompt(first, 2 * BLOCK + 8) for first in (1, 2, 3, 4))
    async with offloading_sim(cpu_offload_blocks=6) as (sim, client):
        for tokens in (a, b, c):
            await complete(client, tokens)
            await written(client, tokens)
        await complete(client, a)  # a device hit; A's blocks on the CPU become the newest
        await complete(client, d)  # the tier is full: the two least recent go
        await written(client, d)
        held = await host_hashes(client)
        removals = [event for event in await cpu_events(sim) if event["type"] == "BlockRemoved"]
    b_head, b_tail = engine_hashes(b)
    assert removals == [
        {"type": "BlockRemoved", "block_hashes": [b_tail, b_head], "medium": "CPU", "group_idx": 0}
    ]
    assert held == {*engine_hashes(a), *engine_hashes(c), *engine_hashes(d)}


async def test_a_prefix_the_device_lost_is_read_back_from_the_cpu() -> None:
    tokens = prompt(1, 4 * BLOCK + 6)
    read_s = 0.4
    settings = {
        **NO_COMPUTE,
        "time_scale": 1.0,
        # The device holds one prompt (5 blocks with its output); the tier holds both.
        "num_gpu_blocks_override": 5,
        "cpu_offload_blocks": 16,
        "kv_bytes_per_token": 1000,
        "kv_offload_bytes_per_s": 4 * BLOCK * 1000 / read_s,
    }
    fetch = "vllm:num_requests_kv_fetch_by_stage"
    async with offloading_sim(**settings) as (sim, client):
        await complete(client, tokens)
        await written(client, tokens)
        other = prompt(2, 4 * BLOCK + 6)
        await complete(client, other)  # takes every device block
        await written(client, other)
        assert not set(engine_hashes(tokens)) & {
            b["hash"] for b in (await listing(client))["blocks"]
        }

        started = time.monotonic()
        answer = asyncio.create_task(complete(client, tokens))
        await wait_until("the read to be in progress", lambda: read_in_progress(client, fetch))
        cached = await answer
        elapsed = time.monotonic() - started
        device = {block["hash"] for block in (await listing(client))["blocks"]}
        counters = {
            name: await metric(client, f"vllm:{name}_total")
            for name in ("external_prefix_cache_queries", "external_prefix_cache_hits")
        }
        host = await metric(client, "vllm:prompt_tokens_cached_by_source_total", source="host")
        transfer = await metric(
            client, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        loaded = await metric(client, "vllm:kv_offload_load_bytes_total")
        old_name = await metric(
            client, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU"
        )
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 0)
    assert cached == 4 * BLOCK
    assert elapsed >= read_s
    # Read back into device blocks, which enter the prefix cache with their stores.
    assert set(engine_hashes(tokens)) <= device
    batches = [decode_payload(frames[3])[1] for frames in replies[:-1]]
    device_stores = [
        event["block_hashes"]
        for batch in batches
        for event in batch
        if event["type"] == "BlockStored" and event["medium"] == "GPU"
    ]
    assert device_stores == [engine_hashes(tokens), engine_hashes(other), engine_hashes(tokens)]
    # Three prompts' tokens the device missed, one prompt's blocks found on the CPU.
    assert counters == {
        "external_prefix_cache_queries": 3 * len(tokens),
        "external_prefix_cache_hits": 4 * BLOCK,
    }
    assert host == transfer == 4 * BLOCK
    assert loaded == old_name == 4 * BLOCK * 1000


async def read_in_progress(client: httpx.AsyncClient, fetch: str) -> bool:
    return await metric(client, fetch, stage="in_progress") == 1


async def test_a_request_waits_for_blocks_still_being_written_then_reads_its_last() -> None:
    # A prompt of whole blocks: a device hit keeps the last to compute, and vLLM's
    # connector offers it from the CPU, once written.
    tokens = prompt(1, 4 * BLOCK)
    write_s = 1.0
    settings = {
        **NO_COMPUTE,
        "time_scale": 1.0,
        "cpu_offload_blocks": 16,
        "kv_bytes_per_token": 1000,
        "kv_offload_bytes_per_s": 4 * BLOCK * 1000 / write_s,
    }
    async with offloading_sim(**settings) as (_, client):
        first = await complete(client, tokens)
        started = time.monotonic()
        again = await complete(client, tokens)  # its last block is still being written
        elapsed = time.monotonic() - started
        device = await metric(client, "vllm:prompt_tokens_cached_by_source_total", source="device")
        host = await metric(client, "vllm:prompt_tokens_cached_by_source_total", source="host")
        computed = await metric(
            client, "vllm:prompt_tokens_by_source_total", source="local_compute"
        )
    assert (first, again) == (0, 4 * BLOCK)
    assert elapsed >= write_s / 2  # it waited for the write (the read is a quarter of it)
    assert (device, host) == (3 * BLOCK, BLOCK)
    assert computed == 4 * BLOCK  # the first request's; the second recomputes one token only


@pytest.mark.parametrize("wire_format", ["vllm-0.32", "vllm-0.23"])
async def test_the_agent_credits_cpu_blocks_to_the_host_tier(wire_format: str) -> None:
    a, b = prompt(1, 2 * BLOCK + 8), prompt(2, 2 * BLOCK + 8)
    async with offloading_sim(cpu_offload_blocks=2, kv_events_format=wire_format) as (sim, client):
        await complete(client, a)
        await written(client, a)
        await complete(client, b)  # A's blocks leave the CPU (not the device) for B's
        await written(client, b)
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 0)
    translator = BlockTranslator(MODEL, BLOCK, max_tracked_blocks=100)
    events: list[KvEvent] = []
    for frames in replies[:-1]:
        decoded = VllmAdapter().decode_batch(frames[-1])
        assert decoded.skipped == ()
        events += translator.translate(decoded.events)
    a_keys, b_keys = (block_keys(tokens, KeyNamespace(MODEL, BLOCK)) for tokens in (a, b))
    stored = [
        key
        for event in events
        if isinstance(event, BlocksStored) and event.tier is Tier.HOST
        for key in event.keys
    ]
    removed = [
        key
        for event in events
        if isinstance(event, BlocksRemoved) and event.tier is Tier.HOST
        for key in event.keys
    ]
    assert stored == a_keys + b_keys
    assert sorted(removed) == sorted(a_keys)
    assert translator.counters.unresolved_blocks == 0


def test_a_cpu_store_is_the_bytes_vllm_032_sends() -> None:
    """Against the batch vLLM 0.32's own classes made (the agent's wire corpus)."""
    vllm_batch = msgspec.msgpack.decode((CORPUS / "vllm-0.32.0-offload.bin").read_bytes())
    placeholder = vllm_batch[1][1]  # a store on the CPU of the block hashed 1002
    ours = msgspec.msgpack.decode(
        EventEncoder(WireFormat.VLLM_0_32).encode_batch(
            0.0, [BlocksOffloaded(((1002).to_bytes(32, "big"),))]
        )
    )[1]
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode([placeholder])


async def test_the_metric_families_say_offloading_as_vllms_do() -> None:
    families = {}
    async with contextlib.AsyncExitStack() as stack:
        for name, settings in (("offloading", {"kv_offloading_size": 0.01}), ("plain", {})):
            _, client = await stack.enter_async_context(offloading_sim(**settings))
            text = (await client.get("/metrics")).text
            families[name] = {
                family.name: family for family in text_string_to_metric_families(text)
            }
    offloading, plain = families["offloading"], families["plain"]
    for family in (
        "vllm:kv_offload_load_bytes",
        "vllm:kv_offload_store_time",
        "vllm:kv_offload_total_bytes",
        "vllm:kv_offload_allocation_failure",
        "vllm:kv_offload_cpu_cache_usage_perc",
        # The connector's role is kv_both: it consumes KV.
        "vllm:num_requests_kv_fetch_by_stage",
    ):
        assert family in offloading
        assert family not in plain
    assert "vllm:nixl_num_failed_transfers" not in offloading
    (info,) = offloading["vllm:cache_config_info"].samples
    assert (info.labels["kv_offloading_size"], info.labels["kv_offloading_backend"]) == (
        "0.01",
        "native",
    )


def test_the_cpu_tier_is_sized_as_vllm_sizes_it() -> None:
    by_size = EngineSimConfig(kv_offloading_size=1)
    assert by_size.cpu_offloading is not None
    # 1 GiB over blocks of 16 tokens x 131072 bytes (2 MiB, whole pages already).
    assert by_size.cpu_offloading.num_blocks == 512
    assert (by_size.kv_connector, by_size.kv_role) == ("OffloadingConnector", "kv_both")
    # A block of 16 x 1000 bytes takes 4 pages: 16384 bytes.
    extra = {"cpu_bytes_to_use": 10 * 16384 + 100}
    by_bytes = EngineSimConfig(
        kv_bytes_per_token=1000,
        kv_transfer_config={**OFFLOADING, "kv_connector_extra_config": extra},
    )
    assert by_bytes.cpu_offloading is not None
    assert by_bytes.cpu_offloading.num_blocks == 10
    assert by_bytes.cpu_offloading.offload_prompt_only
    assert not EngineSimConfig(kv_transfer_config=NIXL).cpu_offloading


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_transfer_config": OFFLOADING}, "cpu_bytes_to_use must be specified"),
        ({"kv_offloading_size": 1, "kv_transfer_config": NIXL}, "MultiConnector"),
        ({"cpu_offload_blocks": 8, "kv_transfer_config": NIXL}, "MultiConnector"),
        ({"cpu_offload_blocks": 8, "kv_offloading_size": 1}, "given twice"),
        (
            {
                "kv_transfer_config": {
                    **OFFLOADING,
                    "kv_connector_extra_config": {"eviction_policy": "arc"},
                }
            },
            "eviction_policy",
        ),
        (
            {
                "cpu_offload_blocks": 8,
                "kv_transfer_config": {
                    **OFFLOADING,
                    "kv_connector_extra_config": {"block_size": 64},
                },
            },
            "one block of 16 tokens",
        ),
        ({"cpu_offload_blocks": 8, "kv_events_format": "vllm-0.9"}, "vllm-0.9"),
        ({"kv_offloading_size": 1e-6}, "would hold no block"),
    ],
)
def test_offloading_settings_vllm_or_the_simulator_refuse_are_refused_clearly(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineSimConfig(**settings)


def test_offloading_beside_nixl_is_refused_at_start_up() -> None:
    stderr = refused_at_start_up(
        "--kv-offloading-size", "4",
        "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
    )  # fmt: skip
    assert "MultiConnector" in stderr
