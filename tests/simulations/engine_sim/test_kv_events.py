"""KV events over real ZMQ sockets: vLLM's frames, payloads, replay and their faults."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import msgspec
import pytest

from simulations.engine_sim.config import KVEventsConfig
from tests.simulations.engine_sim.conftest import (
    END,
    EVENTS,
    decode_payload,
    engine_sim,
    replay,
    subscribed,
)

PROMPT = "Each block of sixteen tokens gets a key that depends on every token before it. " * 3


# The structures as engine-protocols.md documents vLLM 0.32's events, decoded strictly.
class Stored(msgspec.Struct, tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: list[list[str] | None]
    group_idx: int
    kv_cache_spec_kind: str


class Removed(msgspec.Struct, tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str
    group_idx: int


class Cleared(msgspec.Struct, tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None


def decode_batch(payload: bytes) -> Batch:
    return msgspec.msgpack.decode(payload, type=Batch)


async def complete(client: httpx.AsyncClient, prompt: str, **extra: Any) -> None:
    # One output token by default: no decode step then fills a block (and sends a batch).
    body = {"prompt": prompt, "max_tokens": 1, **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


async def test_events_are_vllm_0_32_frames_and_maps() -> None:
    async with (
        engine_sim() as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
        subscribed(sim) as subscriber,
    ):
        await complete(client, PROMPT)
        await complete(client, PROMPT + " and a little more text to fill a new block")
        await complete(client, PROMPT, cache_salt="tenant-a")
        messages = await subscriber.drain()
    assert [frames[0] for frames in messages] == [b"kv-events"] * len(messages)
    assert [int.from_bytes(frames[1], "big") for frames in messages] == list(range(len(messages)))
    assert all(len(frames[1]) == 8 for frames in messages)
    batches = [decode_batch(frames[2]) for frames in messages]
    assert all(batch.data_parallel_rank == 0 for batch in batches)
    stored = [event for batch in batches for event in batch.events if isinstance(event, Stored)]
    assert len(stored) == 3

    # Fields in the order a real 0.32 engine sends them.
    raw = decode_payload(messages[0][2])[1][0]
    assert list(raw) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]  # fmt: skip

    first, extension, salted = stored
    assert first.parent_block_hash is None
    assert len(first.token_ids) == len(first.block_hashes) * first.block_size
    assert first.extra_keys == [None] * len(first.block_hashes)
    assert first.medium == "GPU"
    # The longer prompt reused the cached blocks: its event continues the chain.
    assert extension.parent_block_hash == first.block_hashes[-1]
    # A salted chain starts at token 0 with the salt in its first block's extra keys.
    assert salted.parent_block_hash is None
    assert salted.extra_keys[0] == ["tenant-a"]
    assert all(keys is None for keys in salted.extra_keys[1:])
    assert not set(salted.block_hashes) & set(first.block_hashes)


async def test_eviction_removes_exactly_the_evicted_blocks() -> None:
    async with (
        engine_sim(num_gpu_blocks_override=10, block_size=16) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        for index in range(12):  # far more distinct blocks than the cache holds
            await complete(client, f"{index} {PROMPT}")
        cached = (await client.get("/sim/blocks")).json()["blocks"]
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 0)
    held: Counter[int] = Counter()
    removed = 0
    for frames in replies[:-1]:
        for event in decode_batch(frames[3]).events:
            if isinstance(event, Stored):
                held.update(event.block_hashes)
            elif isinstance(event, Removed):
                (block_hash,) = event.block_hashes
                assert held[block_hash] > 0, "removed a block that was not stored"
                held[block_hash] -= 1
                removed += 1
    assert removed > 0
    assert +held == Counter(block["hash"] for block in cached)
    assert len(cached) <= 10


async def test_replay_returns_the_missed_batches_then_the_end_marker() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        assert sim.replay_endpoint is not None
        async with subscribed(sim) as subscriber:
            for index in range(4):
                await complete(client, f"{index} {PROMPT}")
            published = await subscriber.drain()
        replies = await replay(sim.replay_endpoint, 2)
    assert len(published) == 4
    # DEALER side of a 0.26+ reply: [b"", topic, seq, payload], then [b"", b"", END, b""].
    assert replies[-1] == [b"", b"", END, b""]
    assert replies[:-1] == [[b"", *frames] for frames in published[2:]]


async def test_the_replay_buffer_is_bounded() -> None:
    bounded = KVEventsConfig(**{**EVENTS.model_dump(), "buffer_steps": 2})
    async with (
        engine_sim(kv_events_config=bounded) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        for index in range(5):
            await complete(client, f"{index} {PROMPT}")
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 0)
    sequences = [int.from_bytes(frames[2], "big") for frames in replies[:-1]]
    assert sequences == [3, 4]  # asked for 0: the answer starts later, as vLLM's does


async def test_dropped_batches_leave_a_gap_that_replay_fills() -> None:
    async with (
        engine_sim(drop_event_fraction=0.5, seed=3) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        assert sim.replay_endpoint is not None
        async with subscribed(sim) as subscriber:
            for index in range(12):
                await complete(client, f"{index} {PROMPT}")
            received = await subscriber.drain()
        replies = await replay(sim.replay_endpoint, 0)
    seen = [int.from_bytes(frames[1], "big") for frames in received]
    replayed = [int.from_bytes(frames[2], "big") for frames in replies[:-1]]
    assert replayed == list(range(12))
    assert 0 < len(seen) < 12
    assert set(seen) < set(replayed)


@pytest.mark.parametrize("wire_format", ["vllm-0.23", "vllm-0.9"])
async def test_older_wire_forms(wire_format: str) -> None:
    async with (
        engine_sim(kv_events_format=wire_format) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        await complete(client, PROMPT)
        await client.post("/reset_prefix_cache")
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 0)
    # Up to 0.25 a replay reply has no topic frame: [b"", seq, payload], [b"", END, b""].
    assert replies[-1] == [b"", END, b""]
    batches = [decode_payload(frames[2]) for frames in replies[:-1]]
    stored, cleared = batches[0][1][0], batches[1][1][0]
    assert stored[0] == "BlockStored"
    assert cleared == ["AllBlocksCleared"]
    if wire_format == "vllm-0.23":
        assert len(batches[0]) == 3  # [ts, events, rank]
        assert stored[6] == "GPU"  # medium, after block_hashes..lora_id
        assert len(stored) == 11
    else:
        assert len(batches[0]) == 2  # [ts, events]: no rank before 0.9.2
        assert len(stored) == 6  # block_hashes, parent, token_ids, block_size, lora_id
    assert len(stored[3]) == len(stored[1]) * stored[4]


async def test_hashes_are_32_byte_digests_when_vllm_is_told_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        await complete(client, PROMPT)
        blocks = (await client.get("/sim/blocks")).json()["blocks"]
        assert sim.replay_endpoint is not None
        replies = await replay(sim.replay_endpoint, 0)
    event = decode_payload(replies[0][3])[1][0]
    digests = event["block_hashes"]
    assert all(isinstance(digest, bytes) and len(digest) == 32 for digest in digests)
    # Reduced to their last 8 bytes, read big-endian, they are the integer hashes.
    assert {int.from_bytes(d[-8:], "big") for d in digests} == {b["hash"] for b in blocks}


async def test_reset_and_restart_faults_show_on_the_wire() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        assert sim.replay_endpoint is not None
        async with subscribed(sim) as subscriber:
            await complete(client, PROMPT)
            assert (await client.post("/reset_prefix_cache")).status_code == 200
            assert (await client.get("/sim/blocks")).json()["blocks"] == []
            fault = await client.post("/sim/faults", json={"restart": True})
            assert fault.status_code == 200
            await complete(client, PROMPT)
            messages = await subscriber.drain()
        after_restart = await replay(sim.replay_endpoint, 0)
    sequences = [int.from_bytes(frames[1], "big") for frames in messages]
    assert sequences == [0, 1, 0]  # stored, cleared, then a fresh counter
    assert isinstance(decode_batch(messages[1][2]).events[0], Cleared)
    assert len(after_restart) == 2  # the buffer restarted too: one batch and the end


async def test_bad_fault_requests_change_nothing() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        unknown = await client.post("/sim/faults", json={"explode": True})
        negative = await client.post("/sim/faults", json={"stall_s": -1})
        not_json = await client.post("/sim/faults", content=b"{")
    assert unknown.status_code == negative.status_code == not_json.status_code == 400
    assert sim.engine.publisher is not None
    assert sim.engine.publisher.drop_fraction == 0.0
