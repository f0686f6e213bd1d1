"""Writes the recorded KV event payloads next to this file (run once; the bytes are committed).

    .venv/bin/python -m tests.worker_agent.wire_samples.make_samples

The vLLM forms come from the engine simulator's encoder (which reproduces vLLM's bytes);
the SGLang batch and the reference document's literal vLLM 0.32 event are built by hand.
Everything is deterministic: running it again rewrites the same bytes. The tests read the
`.bin` files, never this script, so a later change to the simulator cannot move them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from simulations.engine_sim.block_hash import block_extra_keys, hash_block, none_hash, wire_hash
from simulations.engine_sim.block_pool import AllBlocksCleared, BlockRemoved, BlocksStored
from simulations.engine_sim.kv_events import EventEncoder, WireFormat

HERE = Path(__file__).parent
BLOCK_SIZE = 4
ROOT = none_hash("")


def chain(
    parent: bytes, tokens: list[int], lora: str | None, salt: str | None, first_index: int
) -> tuple[bytes, ...]:
    digests = []
    for i in range(len(tokens) // BLOCK_SIZE):
        keys = block_extra_keys(first_index + i, lora, salt)
        parent = hash_block(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], keys)
        digests.append(parent)
    return tuple(digests)


def stored(
    parent: bytes | None,
    digests: tuple[bytes, ...],
    tokens: list[int],
    lora: str | None,
    salt: str | None,
    first_index: int,
) -> BlocksStored:
    return BlocksStored(
        digests=digests,
        parent_digest=parent,
        token_ids=tuple(tokens),
        block_size=BLOCK_SIZE,
        lora_name=lora,
        extra_keys=tuple(
            block_extra_keys(first_index + i, lora, salt) for i in range(len(digests))
        ),
    )


def signed_sha_prefix(text: str) -> int:
    """SGLang's hash: the first 16 hex digits of a SHA-256, as a signed int64."""
    value = int(hashlib.sha256(text.encode()).hexdigest()[:16], 16)
    return value - 2**64 if value >= 2**63 else value


def sglang_hash(prefix: str, negative: bool) -> int:
    n = 0
    while (signed_sha_prefix(f"{prefix}-{n}") < 0) != negative:
        n += 1
    return signed_sha_prefix(f"{prefix}-{n}")


def main() -> None:
    samples: dict[str, bytes] = {}
    # A plain chain: two blocks from token 0, then one more block continuing it.
    head_tokens, tail_tokens = [101, 102, 103, 104, 105, 106, 107, 108], [109, 110, 111, 112]
    head = chain(ROOT, head_tokens, None, None, 0)
    tail = chain(head[-1], tail_tokens, None, None, 2)
    plain = [
        stored(None, head, head_tokens, None, None, 0),
        stored(head[-1], tail, tail_tokens, None, None, 2),
    ]
    everything = [*plain, BlockRemoved(tail[0]), AllBlocksCleared()]

    def encode(form: WireFormat, events: list, *, ints: bool = True, ts: float) -> bytes:
        return EventEncoder(form, int_hashes=ints).encode_batch(ts, events)

    samples["vllm-0.32-int"] = encode(WireFormat.VLLM_0_32, plain, ts=1754000000.25)
    samples["vllm-0.32-bytes"] = encode(WireFormat.VLLM_0_32, plain, ints=False, ts=1754000000.25)
    samples["vllm-0.23"] = encode(WireFormat.VLLM_0_23, everything, ts=1754000001.5)
    samples["vllm-0.9"] = encode(WireFormat.VLLM_0_9, everything, ts=1754000002.75)

    # A salted chain, then a LoRA ('sql') chain with the same salt.
    salt_head = chain(ROOT, head_tokens, None, "tenant-a", 0)
    salt_tail = chain(salt_head[-1], tail_tokens, None, "tenant-a", 2)
    samples["vllm-0.32-salt"] = encode(
        WireFormat.VLLM_0_32,
        [
            stored(None, salt_head, head_tokens, None, "tenant-a", 0),
            stored(salt_head[-1], salt_tail, tail_tokens, None, "tenant-a", 2),
        ],
        ts=1754000003.0,
    )
    lora_head = chain(ROOT, head_tokens, "sql", "tenant-a", 0)
    lora_tail = chain(lora_head[-1], tail_tokens, "sql", "tenant-a", 2)
    samples["vllm-0.32-lora-salt"] = encode(
        WireFormat.VLLM_0_32,
        [
            stored(None, lora_head, head_tokens, "sql", "tenant-a", 0),
            stored(lora_head[-1], lora_tail, tail_tokens, "sql", "tenant-a", 2),
        ],
        ts=1754000004.0,
    )
    samples["vllm-0.32-removal"] = encode(
        WireFormat.VLLM_0_32, [BlockRemoved(tail[0]), BlockRemoved(head[1])], ts=1754000005.0
    )
    samples["vllm-0.32-cleared"] = encode(
        WireFormat.VLLM_0_32, [AllBlocksCleared()], ts=1754000006.0
    )

    # SGLang 0.5.23: tagged maps, signed int64 hashes, cache_salt as a field.
    s1, s2 = sglang_hash("sglang-1", True), sglang_hash("sglang-2", True)
    s3 = sglang_hash("sglang-3", False)
    sglang_events = [
        {
            "type": "BlockStored", "block_hashes": [s1, s2], "parent_block_hash": None,
            "token_ids": head_tokens, "block_size": BLOCK_SIZE, "lora_id": None,
            "medium": "CPU_PINNED", "cache_salt": "tenant-a", "session_id": None,
            "lora_name": None,
        },
        {
            "type": "BlockStored", "block_hashes": [s3], "parent_block_hash": s2,
            "token_ids": tail_tokens, "block_size": BLOCK_SIZE, "lora_id": 7, "medium": "GPU",
            "cache_salt": "tenant-a", "session_id": "session-9", "lora_name": "sql",
        },
        {"type": "BlockRemoved", "block_hashes": [s2], "medium": "CPU_PINNED"},
        {"type": "BlockRemoved", "block_hashes": [s3], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    samples["sglang"] = msgspec.msgpack.encode([1754000007.125, sglang_events, 0])

    # The literal vLLM 0.32 events of shared/reference/engine-protocols.md (the document
    # elides 30 of the 32 token ids; these fill them in).
    doc_events = [
        {
            "type": "BlockStored", "block_hashes": [12752553625335714316],
            "parent_block_hash": None, "token_ids": [0, 266, *range(1000, 1030)],
            "block_size": 32, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
        },
        {
            "type": "BlockRemoved", "block_hashes": [12752553625335714316], "medium": "GPU",
            "group_idx": 0,
        },
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    samples["vllm-0.32-doc-example"] = msgspec.msgpack.encode([1754000008.0, doc_events, 0])

    for name, payload in samples.items():
        (HERE / f"{name}.bin").write_bytes(payload)
    # The values the tests expect, for reading off.
    print("head", [wire_hash(d) for d in head], "tail", [wire_hash(d) for d in tail])
    print("salt", [wire_hash(d) for d in salt_head], [wire_hash(d) for d in salt_tail])
    print("lora", [wire_hash(d) for d in lora_head], [wire_hash(d) for d in lora_tail])
    print("sglang", s1, s2, s3)


if __name__ == "__main__":
    main()
