"""One routing decision: the index's matches and this router's predictions, scored."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence

import numpy as np
import pytest
from opentelemetry import trace

from kvplane.core.clock import Clock
from kvplane.core.config import ScoringSettings
from kvplane.core.serving import free_port
from kvplane.core.types import BlocksStored, LoadReport, Tier, WorkerInfo
from router.control_plane.workers import WorkerView
from router.index.base import IndexUnavailable, PrefixMatch
from router.index.memory import MemoryLocationIndex
from router.index.redis import RedisLocationIndex
from router.lifecycle import route_prompt
from router.lifecycle.bodies import Endpoint, parse_body
from router.lifecycle.tokens import PromptStart
from router.routing.accuracy import PredictionAccuracy
from router.routing.decide import (
    INDEX_PROBE_INTERVAL_S,
    Decision,
    RoutingPlanner,
    believed_blocks,
    servable_blocks,
)
from router.routing.evictions import RecentEvictions
from router.routing.pool import WorkerPool
from router.routing.predicted import PredictedPrefixes
from router.scoring.policy import KvplaneScoring, RoundRobin, RoutingPolicy
from router.scoring.score import TIERS
from router.tenants import ANONYMOUS_TENANT, Tenant
from tests.clock import ManualClock

MODEL = "test-model"
BLOCK_SIZE = 4
WORKERS = ("w1", "w2", "w3")
TOKENS = list(range(1000, 1033))  # 33 tokens: 8 full blocks, all of them servable
CAPACITY_BLOCKS = 64
ACME = Tenant(name="acme", cache_scope="acme", cache_salt="acme-salt")
WEIGHTS = ScoringSettings()


class FlakyIndex(MemoryLocationIndex):
    """A memory index whose lookups fail, hang, or hit a bug, while told to."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        self.hanging = False
        self.bug: Exception | None = None
        self.lookups = 0

    async def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        self.lookups += 1
        if self.bug is not None:
            raise self.bug
        if self.failing:
            raise IndexUnavailable("the backend is down")
        if self.hanging:
            await asyncio.sleep(10)
        return await super().lookup(keys)


async def make_planner(
    index: MemoryLocationIndex | None = None,
    *,
    workers: Sequence[str] = WORKERS,
    suspect_after_misses: int = 2,
    index_timeout_s: float = 5.0,
    view: WorkerView | None = None,
    clock: Clock = time.monotonic,
    policy: RoutingPolicy | None = None,
) -> RoutingPlanner:
    view = view if view is not None else WorkerView()
    index = index if index is not None else MemoryLocationIndex(clock=clock)
    for worker_id in workers:
        info = WorkerInfo(
            worker_id=worker_id,
            incarnation=1,
            base_url="http://127.0.0.1:8000",
            model=MODEL,
            block_size=BLOCK_SIZE,
            kv_capacity_blocks=CAPACITY_BLOCKS,
        )
        await index.register(info, lease_s=60.0)
        view.registered(info, stream=1, now=clock(), lease_s=60.0, applied=0)
    pool = WorkerPool(
        index,
        view,
        evictions=RecentEvictions(WEIGHTS.eviction_horizon_s),
        accuracy=PredictionAccuracy(suspect_after_misses, tolerance_tokens=BLOCK_SIZE),
        unreachable_backoff_s=1.0,
        clock=clock,
    )
    await pool.refresh()
    return RoutingPlanner(
        index=index,
        pool=pool,
        predicted=PredictedPrefixes(ttl_s=30.0),
        policy=policy or KvplaneScoring(WEIGHTS),
        block_size=BLOCK_SIZE,
        index_timeout_s=index_timeout_s,
        tracer=trace.NoOpTracer(),
        rng=np.random.default_rng(0),
        clock=clock,
    )


async def store(
    planner: RoutingPlanner, worker_id: str, blocks: int, scope: str = "", tier: Tier = Tier.DEVICE
) -> None:
    keys = planner.keys(MODEL, scope, TOKENS)[:blocks]
    await planner.index.apply(worker_id, 1, [BlocksStored(keys=keys, tier=tier)])


# -- servable_blocks and believed_blocks ---------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_tokens", "blocks"),
    [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (33, 8)],
)
def test_the_last_prompt_token_is_never_served_from_cache(prompt_tokens: int, blocks: int) -> None:
    assert servable_blocks(prompt_tokens, BLOCK_SIZE) == blocks


def believed(limit: int, *rows: tuple[dict[str, int], int]) -> list[dict[Tier, int]]:
    """believed_blocks() of rows of (index match by tier name, predicted blocks)."""
    index_tiers = np.array(
        [[by_tier.get(tier.name.lower(), 0) for tier in TIERS] for by_tier, _ in rows],
        dtype=np.int64,
    ).reshape(len(rows), len(TIERS))
    predicted = np.array([blocks for _, blocks in rows], dtype=np.int64)
    return [
        {tier: int(count) for tier, count in zip(TIERS, row, strict=True) if count}
        for row in believed_blocks(index_tiers, index_tiers.sum(axis=1), predicted, limit)
    ]


def test_without_an_index_match_or_a_prediction_nothing_is_believed() -> None:
    assert believed(8, ({}, 0)) == [{}]


def test_the_index_match_is_kept_within_the_limit() -> None:
    assert believed(8, ({"device": 2, "host": 3}, 0)) == [{Tier.DEVICE: 2, Tier.HOST: 3}]


def test_a_longer_prediction_extends_the_device_tier() -> None:
    assert believed(8, ({"device": 1, "host": 2}, 5), ({}, 5)) == [
        {Tier.DEVICE: 3, Tier.HOST: 2},
        {Tier.DEVICE: 5},
    ]


def test_a_shorter_prediction_changes_nothing() -> None:
    assert believed(8, ({"host": 4}, 2)) == [{Tier.HOST: 4}]


def test_the_slowest_tiers_are_cut_first_to_the_limit() -> None:
    assert believed(
        3, ({"device": 2, "host": 2, "disk": 2}, 0), ({"device": 2, "host": 2}, 10)
    ) == [
        {Tier.DEVICE: 2, Tier.HOST: 1},
        {Tier.DEVICE: 3},
    ]
    assert believed(0, ({"device": 4}, 0)) == [{}]


# -- decide ----------------------------------------------------------------------------


async def test_the_worker_holding_the_prefix_ranks_first() -> None:
    planner = await make_planner()
    await store(planner, "w2", 6)
    await store(planner, "w3", 2)
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert [r.worker_id for r in decision.ranked] == ["w2", "w3", "w1"]
    assert decision.index_answered
    assert decision.factor == "cache"
    assert decision.matched("w2") == {Tier.DEVICE: 6}
    assert decision.matched("w1") == {}
    assert decision.predicted_tokens("w2") == 6 * BLOCK_SIZE
    assert decision.predicted_tokens("w1") == 0
    assert decision.ranked[0].cached_tokens == 6 * BLOCK_SIZE
    assert decision.keys == planner.keys(MODEL, "", TOKENS)
    assert decision.prompt_tokens == len(TOKENS)
    assert set(decision.candidates) == set(WORKERS)


async def test_a_fully_cached_prompt_counts_only_its_servable_blocks() -> None:
    planner = await make_planner()
    tokens = TOKENS[:32]  # 8 full blocks, the last of which holds the last token
    keys = planner.keys(MODEL, "", tokens)
    await planner.index.apply("w1", 1, [BlocksStored(keys=keys, tier=Tier.DEVICE)])
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=tokens
    )
    assert decision.matched("w1") == {Tier.DEVICE: 7}


async def test_a_routed_prefix_is_predicted_on_the_next_decision() -> None:
    planner = await make_planner()
    first = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert first.factor == "tie"
    assert not first.believed.any()
    planner.routed(first, "w3")
    second = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert second.ranked[0].worker_id == "w3"
    assert second.matched("w3") == {Tier.DEVICE: 8}
    assert second.factor == "cache"
    # A prompt sharing only the first half of the prefix is predicted halfway.
    third = await planner.decide(
        model=MODEL,
        tenant=ANONYMOUS_TENANT,
        cache_scope="",
        tokens=[*TOKENS[:16], *range(5000, 5017)],
    )
    assert third.matched("w3") == {Tier.DEVICE: 4}


START = TOKENS[:24]  # 6 full blocks: a prompt's start, its rest not tokenised yet
_CHAT = parse_body(b'{"model": "test-model", "messages": []}', Endpoint.CHAT)


async def _decide_on_start(planner: RoutingPlanner, *, rest_tokens: int = 9) -> Decision:
    return await planner.decide(
        model=MODEL,
        tenant=ANONYMOUS_TENANT,
        cache_scope="",
        tokens=START,
        more_tokens=rest_tokens,
        more_tokens_at_most=rest_tokens * 4,
    )


async def test_a_prompts_start_is_decided_on_with_its_rest_estimated() -> None:
    planner = await make_planner()
    await store(planner, "w2", 6)
    decision = await _decide_on_start(planner)
    assert not decision.whole_prompt
    assert decision.keys == planner.keys(MODEL, "", START)
    assert decision.prompt_tokens == len(START) + 9
    assert decision.matched("w2") == {Tier.DEVICE: 6}  # every block of a start is servable
    assert decision.ranked[0].worker_id == "w2"
    assert not decision.rest_could_change_choice()  # only w2 could hold more, and it leads
    planner.routed(decision, "w2")
    assert planner.predicted.match(decision.keys, time.monotonic()) == {"w2": 6}
    planner.routed_rest(decision, "w2", TOKENS)  # the whole prompt, once tokenised
    assert planner.predicted.match(planner.keys(MODEL, "", TOKENS), time.monotonic()) == {
        "w2": servable_blocks(len(TOKENS), BLOCK_SIZE)
    }


async def test_a_rest_is_keyed_in_its_starts_scope_when_the_start_has_no_whole_block() -> None:
    planner = await make_planner()
    decision = await planner.decide(
        model=MODEL,
        tenant=ACME,
        cache_scope=ACME.cache_scope,
        tokens=TOKENS[:3],  # under a block: no key of its own to chain the rest from
        more_tokens=30,
        more_tokens_at_most=120,
    )
    assert decision.keys == []
    planner.routed_rest(decision, "w1", TOKENS)
    whole = planner.keys(MODEL, ACME.cache_scope, TOKENS)
    now = time.monotonic()
    assert planner.predicted.match(whole, now) == {"w1": servable_blocks(len(TOKENS), BLOCK_SIZE)}
    assert planner.predicted.match(planner.keys(MODEL, "", TOKENS), now) == {}  # not shared


async def test_the_rest_matters_only_where_all_of_the_start_is_held() -> None:
    planner = await make_planner()
    await store(planner, "w2", 5)  # not all of the start: the rest cannot be there
    decision = await _decide_on_start(planner)
    assert decision.ranked[0].worker_id == "w2"
    assert not decision.rest_could_change_choice()


async def test_a_busy_worker_holding_the_whole_start_could_overtake_with_its_rest() -> None:
    planner = await make_planner(workers=["w1", "w2"])
    await store(planner, "w1", 6)
    for _ in range(4):
        planner.pool.sent("w1", "other", prefill_tokens=512)
    decision = await _decide_on_start(planner)
    assert decision.ranked[0].worker_id == "w2"  # w1 holds it all, but is busy
    assert decision.rest_could_change_choice()


def _start_of_tokens(rests: list[int]) -> PromptStart:
    """TOKENS' start, with a rest that counts how often it was tokenised."""

    def rest() -> list[int]:
        rests.append(1)
        return TOKENS

    return PromptStart(START, len(START) + 9, len(START) + 36, rest)


async def test_route_prompt_sends_on_the_start_where_the_rest_cannot_change_the_choice() -> None:
    planner = await make_planner()
    await store(planner, "w2", 6)
    rests: list[int] = []
    decision, start = await route_prompt(
        planner, _CHAT, ANONYMOUS_TENANT, "", _start_of_tokens(rests), True
    )
    assert decision.ranked[0].worker_id == "w2"
    assert not decision.whole_prompt
    assert start is not None
    assert start.rest is not None
    assert rests == []  # left for after the answer


async def test_route_prompt_decides_on_the_whole_where_the_rest_could_change_it() -> None:
    planner = await make_planner(workers=["w1", "w2"])
    await store(planner, "w1", 8)  # all of the start, and the rest's blocks too
    for _ in range(4):
        planner.pool.sent("w1", "other", prefill_tokens=512)
    rests: list[int] = []
    decision, start = await route_prompt(
        planner, _CHAT, ANONYMOUS_TENANT, "", _start_of_tokens(rests), True
    )
    assert rests == [1]
    assert start is not None
    assert start.rest is None
    assert list(start.ids) == TOKENS
    assert decision.whole_prompt
    assert decision.keys == planner.keys(MODEL, "", TOKENS)
    assert decision.matched("w1") == {Tier.DEVICE: 8}  # the rest's blocks counted


async def test_a_start_shorter_than_a_block_says_nothing_of_the_rest() -> None:
    planner = await make_planner()
    decision = await planner.decide(
        model=MODEL,
        tenant=ANONYMOUS_TENANT,
        cache_scope="",
        tokens=TOKENS[:3],
        more_tokens=30,
        more_tokens_at_most=120,
    )
    assert decision.rest_could_change_choice()


async def test_a_decision_is_logged_at_debug_with_numbers_and_hashes_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    planner = await make_planner()
    first = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    with caplog.at_level(logging.INFO, logger="router.routing.decide"):
        planner.routed(first, "w3")
    assert not caplog.records  # nothing unless debugging
    planner.routed(first, "w3")
    turn = [*TOKENS, *range(7000, 7008)]  # the same prefix, extended: a next turn
    second = await planner.decide(model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=turn)
    with caplog.at_level(logging.DEBUG, logger="router.routing.decide"):
        planner.routed(first, "w1")
        planner.routed(second, "w3")
    lines = [record.getMessage() for record in caplog.records]
    prefix = f"{first.keys[-1]:016x}"  # 33 tokens: all 8 blocks servable
    assert lines[0].startswith(
        f"routed 33 prompt tokens (prefix {prefix}, longest match ending at none) to w1 by tie;"
    )
    # A request extending an earlier one names where that one's prompt ended.
    assert lines[1].startswith(
        f"routed 41 prompt tokens (prefix {second.keys[-1]:016x}, longest match ending at "
        f"{prefix}) to w3 by cache;"
    )
    assert "w3 cached=32 saved=32" in lines[1]
    logged = " ".join(lines)
    assert not any(re.search(rf"\b{token}\b", logged) for token in turn)  # no token ids


async def test_a_prediction_extends_a_shorter_index_match() -> None:
    planner = await make_planner()
    await store(planner, "w1", 3, tier=Tier.HOST)
    first = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    planner.routed(first, "w1")
    second = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert second.matched("w1") == {Tier.HOST: 3, Tier.DEVICE: 5}


async def test_another_cache_scope_matches_nothing() -> None:
    planner = await make_planner()
    await store(planner, "w2", 8, scope="")
    assert planner.keys(MODEL, "acme-salt", TOKENS) != planner.keys(MODEL, "", TOKENS)
    decision = await planner.decide(
        model=MODEL, tenant=ACME, cache_scope="acme-salt", tokens=TOKENS
    )
    assert not decision.believed.any()
    assert decision.factor == "tie"
    await store(planner, "w1", 8, scope="acme-salt")
    decision = await planner.decide(
        model=MODEL, tenant=ACME, cache_scope="acme-salt", tokens=TOKENS
    )
    assert decision.ranked[0].worker_id == "w1"
    assert decision.matched("w2") == {}


async def test_a_suspect_workers_match_saves_nothing() -> None:
    planner = await make_planner(suspect_after_misses=2)
    await store(planner, "w2", 8)
    for _ in range(2):
        planner.pool.accuracy.observe("w2", 1, predicted_tokens=32, reported_tokens=0)
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    by_worker = {r.worker_id: r for r in decision.ranked}
    assert by_worker["w2"].saved_tokens == 0.0
    assert by_worker["w2"].cached_tokens == 32  # still what the index believes
    assert decision.matched("w2") == {Tier.DEVICE: 8}


async def test_this_routers_traffic_counts_as_load() -> None:
    planner = await make_planner(workers=["w1", "w2"])
    await store(planner, "w1", 1)
    for _ in range(2):
        planner.pool.sent("w1", "other", prefill_tokens=512)
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert decision.ranked[0].worker_id == "w2"
    assert decision.factor == "load"
    busy = next(r for r in decision.ranked if r.worker_id == "w1")
    assert busy.queue_penalty == pytest.approx(
        2 * WEIGHTS.waiting_request_tokens + 1024 * WEIGHTS.queued_prefill_weight
    )


async def test_a_worker_evicting_its_cache_pays_for_the_new_tokens_sent_there() -> None:
    clock = ManualClock()
    planner = await make_planner(workers=["w1", "w2"], clock=clock)
    planner.pool.evictions.record("w1", CAPACITY_BLOCKS // 2, clock())
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert [r.worker_id for r in decision.ranked] == ["w2", "w1"]
    assert decision.factor == "memory"
    evicting = decision.ranked[1]
    assert evicting.memory_penalty == pytest.approx(0.5 * len(TOKENS))
    clock.advance(WEIGHTS.eviction_horizon_s * 20)  # long since: forgotten
    later = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert all(r.memory_penalty < 0.01 for r in later.ranked)


async def test_requests_sent_since_the_last_load_report_add_to_its_queue() -> None:
    clock = ManualClock(10.0)
    view = WorkerView()
    planner = await make_planner(workers=["w1"], view=view, clock=clock)
    planner.pool.sent("w1", "other", prefill_tokens=0)  # counted in the report already
    clock.now = 11.0
    view.load("w1", 1, LoadReport(running=1, waiting=2, kv_usage=0.0, timestamp_ms=0), 11.0)
    clock.now = 12.0
    planner.pool.sent("w1", "other", prefill_tokens=0)  # sent after the report arrived
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    (only,) = decision.ranked
    assert only.queue_penalty == pytest.approx(
        3 * WEIGHTS.waiting_request_tokens + 1 * WEIGHTS.running_request_tokens
    )


async def test_a_model_no_worker_registered_goes_to_any_worker_on_load() -> None:
    # A LoRA adapter is served under its base model's registration: the engine judges.
    planner = await make_planner()
    await store(planner, "w2", 8)
    decision = await planner.decide(
        model="an-adapter", tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert {breakdown.worker_id for breakdown in decision.ranked} == set(WORKERS)
    assert all(breakdown.cached_tokens == 0 for breakdown in decision.ranked)


async def test_no_live_worker_ranks_nothing() -> None:
    planner = await make_planner(workers=[])
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert list(decision.ranked) == []
    assert decision.factor == "none"


async def test_a_failing_index_leaves_load_only_routing() -> None:
    index = FlakyIndex()
    clock = ManualClock()
    planner = await make_planner(index, clock=clock)
    await store(planner, "w2", 8)
    index.failing = True
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert not decision.index_answered
    assert not planner.index_answering
    assert len(decision.ranked) == len(WORKERS)
    assert not decision.believed.any()
    index.failing = False
    clock.advance(INDEX_PROBE_INTERVAL_S)  # the next probe of the index
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert decision.index_answered
    assert planner.index_answering
    assert decision.ranked[0].worker_id == "w2"


async def test_a_failing_index_still_sees_this_routers_predictions() -> None:
    index = FlakyIndex()
    planner = await make_planner(index)
    first = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    planner.routed(first, "w1")
    index.failing = True
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert not decision.index_answered
    assert decision.ranked[0].worker_id == "w1"
    assert decision.matched("w1") == {Tier.DEVICE: 8}


async def test_an_index_slower_than_its_timeout_counts_as_not_answering() -> None:
    index = FlakyIndex()
    planner = await make_planner(index, index_timeout_s=0.05)
    index.hanging = True
    decision = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert not decision.index_answered
    assert not planner.index_answering
    assert decision.seconds < 5
    # Until the next probe, requests do not wait for the silent index at all.
    lookups_before = index.lookups
    again = await planner.decide(
        model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
    )
    assert not again.index_answered
    assert index.lookups == lookups_before


async def test_an_unreachable_redis_leaves_load_only_routing() -> None:
    planner = await make_planner()  # the workers registered in memory; lookups in Redis
    planner.index = RedisLocationIndex.from_url(
        f"redis://127.0.0.1:{free_port()}/0", prefix="kvptest-down"
    )
    try:
        decision = await planner.decide(
            model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
        )
    finally:
        await planner.index.close()
    assert not decision.index_answered
    assert not planner.index_answering
    assert len(decision.ranked) == len(WORKERS)


@pytest.mark.parametrize("bug", [TypeError("a bug"), KeyError("w1")], ids=["TypeError", "KeyError"])
async def test_a_bug_in_the_index_is_raised_not_taken_for_an_outage(bug: Exception) -> None:
    index = FlakyIndex()
    planner = await make_planner(index)
    index.bug = bug
    with pytest.raises(type(bug)):
        await planner.decide(model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS)
    assert planner.index_answering  # no load-only routing on a bug


async def test_the_round_robin_baseline_takes_turns_whatever_the_scores() -> None:
    planner = await make_planner(policy=RoundRobin(WEIGHTS))
    await store(planner, "w2", 8)
    firsts = []
    for _ in range(4):
        decision = await planner.decide(
            model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS
        )
        assert decision.factor == "round_robin"
        assert len(decision.ranked) == len(WORKERS)
        assert decision.matched("w2") == {Tier.DEVICE: 8}  # still computed
        firsts.append(decision.ranked[0].worker_id)
    assert firsts == ["w1", "w2", "w3", "w1"]
