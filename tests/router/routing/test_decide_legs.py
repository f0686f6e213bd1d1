"""One routing decision under prefill/decode disaggregation: whole requests never go to
a prefill worker while another can take them, and a split request's prefill worker is
the best that can hand its KV to the decode worker (router/routing/decide.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from opentelemetry import trace

from kvplane.core.config import DisaggregationSettings, ScoringSettings
from kvplane.core.types import WorkerInfo, WorkerRole
from router.control_plane.workers import WorkerView
from router.index.memory import MemoryLocationIndex
from router.routing.accuracy import PredictionAccuracy
from router.routing.decide import Decision, RoutingPlanner
from router.routing.evictions import RecentEvictions
from router.routing.pool import WorkerPool
from router.routing.predicted import PredictedPrefixes
from router.scoring.disaggregation import LegReason
from router.scoring.policy import KvplaneScoring
from router.tenants import ANONYMOUS_TENANT
from tests.router.routing.test_decide import BLOCK_SIZE, CAPACITY_BLOCKS, MODEL, TOKENS, store

NIXL = "NixlConnector"
FAST = ScoringSettings()  # 12,500 tokens/s: a 33-token prompt is cheaper whole anywhere
# 100 tokens/s: computing TOKENS' 33 costs 0.33 s, pulling their KV under a millisecond.
SLOW = ScoringSettings(prefill_tokens_per_s=100.0)


def role(worker_id: str, worker_role: WorkerRole, connector: str = NIXL) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        incarnation=1,
        base_url=f"http://{worker_id}:8000",
        model=MODEL,
        block_size=BLOCK_SIZE,
        kv_capacity_blocks=CAPACITY_BLOCKS,
        engine_kind="vllm",
        role=worker_role,
        kv_connector=connector,
    )


def prefill(worker_id: str, connector: str = NIXL) -> WorkerInfo:
    return role(worker_id, WorkerRole.PREFILL, connector)


def decode(worker_id: str, connector: str = NIXL) -> WorkerInfo:
    return role(worker_id, WorkerRole.DECODE, connector)


def both(worker_id: str, connector: str = NIXL) -> WorkerInfo:
    return role(worker_id, WorkerRole.BOTH, connector)


async def make_planner(
    workers: Sequence[WorkerInfo],
    *,
    weights: ScoringSettings = FAST,
    disaggregation: DisaggregationSettings | None = None,
) -> RoutingPlanner:
    """test_decide.py's planner, over workers registered with their roles."""
    view = WorkerView()
    index = MemoryLocationIndex()
    for info in workers:
        await index.register(info, lease_s=60.0)
        view.registered(info, stream=1, now=0.0, lease_s=60.0, applied=0)
    pool = WorkerPool(
        index,
        view,
        evictions=RecentEvictions(weights.eviction_horizon_s),
        accuracy=PredictionAccuracy(2, tolerance_tokens=BLOCK_SIZE),
        unreachable_backoff_s=1.0,
    )
    await pool.refresh()
    return RoutingPlanner(
        index=index,
        pool=pool,
        predicted=PredictedPrefixes(ttl_s=30.0),
        policy=KvplaneScoring(weights),
        block_size=BLOCK_SIZE,
        index_timeout_s=5.0,
        tracer=trace.NoOpTracer(),
        disaggregation=disaggregation,
        rng=np.random.default_rng(0),
    )


async def decide(planner: RoutingPlanner) -> Decision:
    return await planner.decide(model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=TOKENS)


def ranked_ids(decision: Decision) -> list[str]:
    return [breakdown.worker_id for breakdown in decision.ranked]


async def test_a_prefill_worker_holding_the_prefix_takes_its_prefill_leg_not_the_whole() -> None:
    planner = await make_planner([prefill("p"), decode("d1"), decode("d2")], weights=SLOW)
    await store(planner, "p", 8)
    decision = await decide(planner)
    assert "p" not in ranked_ids(decision)
    assert sorted(ranked_ids(decision)) == ["d1", "d2"]
    legs = decision.legs
    assert legs is not None
    assert legs.reason is LegReason.SPLIT_CHEAPER
    assert legs.split
    assert legs.prefill_worker == "p"
    assert legs.decode_worker == decision.ranked[0].worker_id
    assert decision.prefill_worker_ids(3) == ["p"]
    assert decision.prefill_worker_ids(0) == []
    # p computes the one token it lacks (33 - 32 servable); the decode worker pulls all 33.
    assert legs.transfer_bytes == len(TOKENS) * SLOW.kv_bytes_per_token
    assert legs.whole_s is not None
    assert legs.split_s is not None
    assert legs.whole_s == pytest.approx(len(TOKENS) / 100.0)
    assert legs.split_s < legs.whole_s


async def test_the_prefill_workers_are_offered_best_first() -> None:
    workers = [prefill("p1"), prefill("p2"), prefill("p3"), decode("d")]
    planner = await make_planner(workers, weights=SLOW)
    await store(planner, "p2", 8)
    await store(planner, "p3", 4)
    decision = await decide(planner)
    assert ranked_ids(decision) == ["d"]
    assert decision.legs is not None
    assert decision.legs.prefill_worker == "p2"
    assert decision.prefill_worker_ids(3) == ["p2", "p3", "p1"]
    assert decision.prefill_worker_ids(2) == ["p2", "p3"]


async def test_a_short_prompt_is_served_whole_on_its_decode_worker() -> None:
    planner = await make_planner([prefill("p"), decode("d")], weights=FAST)
    await store(planner, "p", 8)
    decision = await decide(planner)
    assert ranked_ids(decision) == ["d"]  # still not the prefill worker
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.WHOLE_CHEAPER
    assert decision.legs.prefill_worker is None
    assert decision.prefill_ranked is None
    assert decision.prefill_worker_ids(3) == []


async def test_decode_workers_without_a_prefill_worker_serve_whole() -> None:
    planner = await make_planner([decode("d1"), decode("d2")], weights=SLOW)
    await store(planner, "d2", 8)
    decision = await decide(planner)
    assert ranked_ids(decision)[0] == "d2"
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.NO_PREFILL_WORKER
    assert decision.legs.decode_worker == "d2"
    assert not decision.legs.split
    assert decision.prefill_worker_ids(3) == []


async def test_prefill_workers_alone_take_whole_requests() -> None:
    planner = await make_planner([prefill("p1"), prefill("p2")], weights=SLOW)
    await store(planner, "p2", 8)
    decision = await decide(planner)
    assert ranked_ids(decision)[0] == "p2"
    assert sorted(ranked_ids(decision)) == ["p1", "p2"]
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.NO_DECODE_WORKER
    assert decision.prefill_worker_ids(3) == []


async def test_a_model_without_connectors_has_no_legs() -> None:
    planner = await make_planner([both("w1", ""), both("w2", "")], weights=SLOW)
    await store(planner, "w1", 8)
    decision = await decide(planner)
    assert ranked_ids(decision)[0] == "w1"
    assert decision.legs is None
    assert decision.prefill_ranked is None
    assert decision.prefill_worker_ids(3) == []


async def test_mode_never_serves_whole_and_still_keeps_prefill_workers_out() -> None:
    never = DisaggregationSettings(mode="never")
    planner = await make_planner([prefill("p"), decode("d")], weights=SLOW, disaggregation=never)
    await store(planner, "p", 8)
    decision = await decide(planner)
    assert ranked_ids(decision) == ["d"]
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.NEVER
    assert decision.legs.decode_worker == "d"
    assert decision.prefill_worker_ids(3) == []


async def test_mode_always_splits_between_two_both_workers() -> None:
    always = DisaggregationSettings(mode="always")
    planner = await make_planner([both("a"), both("b")], weights=FAST, disaggregation=always)
    await store(planner, "a", 8)
    decision = await decide(planner)
    assert ranked_ids(decision)[0] == "a"  # the whole request's worker decodes
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.ALWAYS
    assert (decision.legs.decode_worker, decision.legs.prefill_worker) == ("a", "b")
    assert decision.prefill_worker_ids(3) == ["b"]  # never the decode worker itself


async def test_one_both_worker_with_a_connector_has_no_peer_to_split_with() -> None:
    always = DisaggregationSettings(mode="always")
    planner = await make_planner([both("a")], weights=SLOW, disaggregation=always)
    decision = await decide(planner)
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.NO_TRANSFER
    assert not decision.legs.split
    assert decision.prefill_worker_ids(3) == []


async def test_a_prefill_leg_goes_only_to_a_worker_with_the_decode_workers_connector() -> None:
    always = DisaggregationSettings(mode="always")
    workers = [prefill("p-lm", "LMCacheConnectorV1"), prefill("p-nixl"), decode("d")]
    planner = await make_planner(workers, weights=SLOW, disaggregation=always)
    await store(planner, "p-lm", 8)  # holds it all, but cannot hand its KV to d
    decision = await decide(planner)
    assert ranked_ids(decision) == ["d"]
    assert decision.legs is not None
    assert decision.legs.prefill_worker == "p-nixl"
    assert decision.prefill_worker_ids(3) == ["p-nixl"]


async def test_a_decode_worker_without_a_matching_prefill_worker_is_whole() -> None:
    always = DisaggregationSettings(mode="always")
    workers = [prefill("p", "LMCacheConnectorV1"), decode("d")]
    planner = await make_planner(workers, weights=SLOW, disaggregation=always)
    decision = await decide(planner)
    assert ranked_ids(decision) == ["d"]
    assert decision.legs is not None
    assert decision.legs.reason is LegReason.NO_TRANSFER
    assert decision.prefill_worker_ids(3) == []
