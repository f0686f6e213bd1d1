"""Batches made by vLLM's and SGLang's own event classes (wire_corpus/; the scripts
there make them): decoded, translated, and checked against the keys the router
computes for the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.types import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    SkipReason,
    Tier,
)
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import SkippedEvent
from worker_agent.translate import BlockTranslator

CORPUS = Path(__file__).parent / "wire_corpus"
MODEL = "corpus-model"
BLOCK_SIZE = 4
SALT = "tenant-a"  # what the SGLang batches' salted stores carry
KEYS = block_keys(list(range(1, 9)), KeyNamespace(MODEL, BLOCK_SIZE))  # what the router keys


def agent_events(name: str) -> tuple[list[KvEvent], tuple[SkippedEvent, ...], BlockTranslator]:
    decoded = VllmAdapter().decode_batch((CORPUS / f"vllm-{name}.bin").read_bytes())
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=100)
    return translator.translate(decoded.events), decoded.skipped, translator


def test_the_corpus_was_made_by_a_real_vllm() -> None:
    assert (CORPUS / "VERSION").read_text().startswith("vllm 0.")


def test_an_offloaded_block_is_credited_to_its_tier_and_outlives_its_gpu_copy() -> None:
    events, skipped, translator = agent_events("offload")
    assert skipped == ()
    assert events == [
        BlocksStored(keys=KEYS, tier=Tier.DEVICE),
        BlocksStored(keys=KEYS[1:], tier=Tier.HOST, first_position=1, parent_key=KEYS[0]),
        BlocksRemoved(keys=KEYS, tier=Tier.DEVICE),
    ]
    # The block offloaded to storage was never stored with its tokens: counted.
    assert (translator.counters.offloaded_blocks, translator.counters.unresolved_blocks) == (1, 1)
    # What a new incarnation would send: the host copy only.
    assert translator.snapshot() == [
        BlocksStored(keys=KEYS[1:], tier=Tier.HOST, first_position=1, parent_key=KEYS[0])
    ]


def test_a_lowercase_medium_is_its_tier() -> None:
    events, skipped, _ = agent_events("lowercase-medium")
    assert skipped == ()
    assert events == [
        BlocksStored(keys=KEYS, tier=Tier.HOST),
        BlocksRemoved(keys=KEYS[1:], tier=Tier.HOST),
    ]


def test_blocks_another_node_holds_are_never_the_publishers() -> None:
    events, skipped, _ = agent_events("remote")
    assert skipped == (
        SkippedEvent("BlockStored", SkipReason.REMOTE),
        SkippedEvent("BlockRemoved", SkipReason.REMOTE),
    )
    assert events == [BlocksStored(keys=KEYS, tier=Tier.DEVICE), AllBlocksCleared()]


@pytest.mark.parametrize(
    ("release", "salt"),
    [("0.5.17", ""), ("0.5.18", SALT), ("0.5.19", SALT), ("0.5.20", SALT), ("0.5.23", SALT)],
)
def test_every_sglang_releases_events_key_as_the_router_does(release: str, salt: str) -> None:
    # Up to 0.5.17 no salt reaches the wire: the chain is keyed in the shared scope.
    decoded = SglangAdapter().decode_batch((CORPUS / f"sglang-{release}.bin").read_bytes())
    assert decoded.skipped == ()
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=100)
    keys = block_keys(list(range(1, 9)), KeyNamespace(MODEL, BLOCK_SIZE, cache_scope=salt))
    assert translator.translate(decoded.events) == [
        BlocksStored(keys=keys[:1], tier=Tier.DEVICE),
        BlocksStored(keys=keys[1:], tier=Tier.HOST, first_position=1, parent_key=keys[0]),
        BlocksRemoved(keys=keys[:1], tier=Tier.DEVICE),
        AllBlocksCleared(),
    ]
