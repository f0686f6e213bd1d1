"""Writes KV event batches made by vLLM's own event classes next to this file.

Run it with the vLLM environment's Python (`make vllm-env`), from the repository root:

    .vllm-venv/bin/python tests/worker_agent/wire_corpus/make_corpus.py

It imports only vLLM (and msgspec, which vLLM encodes with): each batch is built from
`vllm.distributed.kv_events`' classes, with the arguments the named vLLM code passes, and
encoded as vLLM's ZMQ publisher encodes it. The bytes are committed, and the tests read
them without vLLM. Running it again rewrites the same bytes for the same vLLM release;
the release is written into `VERSION`.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import vllm
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

HERE = Path(__file__).parent
TS = 1754000100.0
BLOCK_SIZE = 4
TOKENS = list(range(1, 9))  # two blocks
HEAD, TAIL = 1001, 1002  # the engine's hashes of the two blocks
UNSEEN = 1999  # a hash no store with tokens ever named


def gpu_store(medium: str = "GPU", **fields: object) -> BlockStored:
    return BlockStored(
        block_hashes=[HEAD, TAIL],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None, None],
        group_idx=0,
        **fields,  # type: ignore[arg-type]
    )


def placeholder(block_hash: int, medium: str) -> BlockStored:
    """As the offloading connector's OffloadingEventsTracker._placeholder_stored builds
    it (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py)."""
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        lora_id=None,
        block_size=0,
        medium=medium,
        lora_name=None,
        group_idx=0,
        locality=None,
        ownership=None,
    )


CASES: dict[str, list[object]] = {
    # A GPU store, its tail offloaded to the CPU and an unseen block to storage, then the
    # GPU copies evicted.
    "offload": [
        gpu_store(),
        placeholder(TAIL, "CPU"),
        placeholder(UNSEEN, "STORAGE"),
        BlockRemoved(block_hashes=[HEAD, TAIL], medium="GPU", group_idx=0),
    ],
    # The medium as vLLM 0.32's Mooncake store worker and LMCache name it.
    "lowercase-medium": [
        gpu_store(medium="cpu"),
        BlockRemoved(block_hashes=[TAIL], medium="cpu", group_idx=0),
    ],
    # A block another node holds, between two of the publisher's own events.
    "remote": [
        gpu_store(medium="CPU", locality="REMOTE"),
        gpu_store(locality="LOCAL"),
        BlockRemoved(block_hashes=[HEAD], medium="CPU", group_idx=0, locality="REMOTE"),
        AllBlocksCleared(),
    ],
}


def main() -> None:
    encoder = msgspec.msgpack.Encoder()  # as ZmqEventPublisher encodes a batch
    for name, events in CASES.items():
        batch = KVEventBatch(ts=TS, events=events, data_parallel_rank=0)  # type: ignore[arg-type]
        (HERE / f"vllm-{name}.bin").write_bytes(encoder.encode(batch))
    (HERE / "VERSION").write_text(f"vllm {vllm.__version__}\n")


if __name__ == "__main__":
    main()
