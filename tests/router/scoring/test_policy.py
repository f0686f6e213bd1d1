"""The routing policies: kvplane's ranks by score, round-robin takes turns; both explain
their decisions with the same score breakdowns, and the settings name them."""

from __future__ import annotations

from typing import get_args

import numpy as np

from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier
from router.scoring.policy import POLICIES, KvplaneScoring, RoundRobin, configured_policy
from router.scoring.score import RequestFacts, score_candidates
from tests.router.scoring.facts import WorkerFacts, facts_of

WEIGHTS = ScoringSettings()
REQUEST = RequestFacts(prompt_tokens=4096)
WORKERS = facts_of(
    [
        WorkerFacts("c", {}),
        WorkerFacts("a", {Tier.DEVICE: 3072}),
        WorkerFacts("b", {}, waiting_requests=4),
    ]
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_kvplane_ranks_by_score_and_names_the_deciding_factor() -> None:
    ranking = KvplaneScoring(WEIGHTS).rank(REQUEST, WORKERS, rng(3))
    assert [b.worker_id for b in ranking.ranked] == ["a", "c", "b"]
    assert ranking.ranked[0] == score_candidates(REQUEST, WORKERS, WEIGHTS).breakdown(1)
    assert ranking.factor == "cache"


def test_round_robin_takes_turns_in_worker_id_order_whatever_the_scores() -> None:
    policy = RoundRobin(WEIGHTS)
    rankings = [policy.rank(REQUEST, WORKERS, rng()) for _ in range(4)]
    assert [[b.worker_id for b in r.ranked] for r in rankings] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert {r.factor for r in rankings} == {"round_robin"}
    # Still explained: each worker's own score breakdown.
    assert rankings[1].ranked[0] == score_candidates(REQUEST, WORKERS, WEIGHTS).breakdown(2)


def test_round_robin_skips_ineligible_workers_and_takes_no_turn_without_any() -> None:
    policy = RoundRobin(WEIGHTS)
    dedicated = RequestFacts(prompt_tokens=64, isolation="dedicated", pool="gold")
    pool = facts_of(
        [
            WorkerFacts("x", {}, pool="gold"),
            WorkerFacts("y", {}),
            WorkerFacts("z", {}, pool="gold"),
        ]
    )
    nobody = policy.rank(dedicated, facts_of([WorkerFacts("y", {})]), rng())
    assert (list(nobody.ranked), nobody.factor) == ([], "none")
    firsts = [policy.rank(dedicated, pool, rng()).ranked[0].worker_id for _ in range(3)]
    assert firsts == ["x", "z", "x"]


def test_the_settings_name_exactly_the_policies_there_are() -> None:
    names = get_args(ScoringSettings.model_fields["policy"].annotation)
    assert set(names) == set(POLICIES)
    for name in names:
        assert configured_policy(WEIGHTS.model_copy(update={"policy": name})).name == name
