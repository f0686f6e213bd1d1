"""Batches made by vLLM's and SGLang's own event classes, release by release
(wire_corpus/; its make_corpus.py makes them): decoded, translated, and checked
against the keys the router computes for the prompt."""

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
from worker_agent.engines.base import EngineAdapter
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import SkippedEvent
from worker_agent.translate import BlockTranslator

CORPUS = Path(__file__).parent / "wire_corpus"
MODEL = "corpus-model"
BLOCK_SIZE = 4
TOKENS = list(range(1, 9))
SALT = "tenant-a"  # what the batches' salted chains carry, where a release can say so
KEYS = block_keys(TOKENS, KeyNamespace(MODEL, BLOCK_SIZE))  # the unsalted chain's
OFFLOADING_RELEASES = pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])


def agent_events(
    name: str, adapter: EngineAdapter | None = None
) -> tuple[list[KvEvent], tuple[SkippedEvent, ...], BlockTranslator]:
    decoded = (adapter or VllmAdapter()).decode_batch((CORPUS / f"{name}.bin").read_bytes())
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=100)
    return translator.translate(decoded.events), decoded.skipped, translator


def chain_events(salt: str, tier_of_second: Tier, removed: int) -> list[KvEvent]:
    """A chain of two blocks stored one by one, the second on `tier_of_second`; block
    `removed` (0 or 1) then removed from its tier; then the cache cleared."""
    keys = block_keys(TOKENS, KeyNamespace(MODEL, BLOCK_SIZE, cache_scope=salt))
    tiers = [Tier.DEVICE, tier_of_second]
    return [
        BlocksStored(keys=keys[:1], tier=Tier.DEVICE),
        BlocksStored(keys=keys[1:], tier=tier_of_second, first_position=1, parent_key=keys[0]),
        BlocksRemoved(keys=keys[removed : removed + 1], tier=tiers[removed]),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    ("release", "salt"),
    # Before extra_keys (vLLM 0.18) no salt reaches the wire: the shared scope.
    [("0.9.2", ""), ("0.23.0", SALT), ("0.32.0", SALT), ("0.33.0", SALT)],
)
def test_every_vllm_releases_chain_keys_as_the_router_does(release: str, salt: str) -> None:
    events, skipped, _ = agent_events(f"vllm-{release}-chain")
    assert skipped == ()
    assert events == chain_events(salt, Tier.DEVICE, removed=1)


@pytest.mark.parametrize(
    ("release", "salt"),
    # Up to 0.5.17 no salt reaches the wire: the shared scope.
    [("0.5.17", ""), ("0.5.18", SALT), ("0.5.19", SALT), ("0.5.20", SALT), ("0.5.23", SALT)],
)
def test_every_sglang_releases_chain_keys_as_the_router_does(release: str, salt: str) -> None:
    events, skipped, _ = agent_events(f"sglang-{release}-chain", SglangAdapter())
    assert skipped == ()
    assert events == chain_events(salt, Tier.HOST, removed=0)


@OFFLOADING_RELEASES
def test_an_offloaded_block_is_credited_to_its_tier_and_outlives_its_gpu_copy(
    release: str,
) -> None:
    events, skipped, translator = agent_events(f"vllm-{release}-offload")
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


@OFFLOADING_RELEASES
def test_a_lowercase_medium_is_its_tier(release: str) -> None:
    events, skipped, _ = agent_events(f"vllm-{release}-lowercase-medium")
    assert skipped == ()
    assert events == [
        BlocksStored(keys=KEYS, tier=Tier.HOST),
        BlocksRemoved(keys=KEYS[1:], tier=Tier.HOST),
    ]


@OFFLOADING_RELEASES
def test_blocks_another_node_holds_are_never_the_publishers(release: str) -> None:
    events, skipped, _ = agent_events(f"vllm-{release}-remote")
    assert skipped == (
        SkippedEvent("BlockStored", SkipReason.REMOTE),
        SkippedEvent("BlockRemoved", SkipReason.REMOTE),
    )
    assert events == [BlocksStored(keys=KEYS, tier=Tier.DEVICE), AllBlocksCleared()]
