"""Routing policies: what turns the facts of one request and its candidate workers into
a ranking. The router's planner (router/routing/decide.py) and the fleet simulator
(simulations/fleet_sim/policies.py) both hold one, gather the facts their own way, and act
on the ranking themselves.

A policy only decides (as the WorkerSelector of NVIDIA Dynamo's KV router): it reads
facts (columns, one row per candidate), draws from the caller's random generator, and
returns workers best first with their score breakdowns, so that every decision is
explained the same way whatever the policy. It books nothing: predicted entries and
traffic are the caller's, recorded once it has sent the request. The only state a
policy keeps is its own cursor (round-robin's turn).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import numpy as np

from kvplane.core.config import ScoringSettings
from router.scoring.score import (
    CandidateFacts,
    RankedWorkers,
    RequestFacts,
    deciding_factor,
    hit_values,
    rank_by_score,
    score_candidates,
)


class Ranking(NamedTuple):
    ranked: RankedWorkers  # the eligible workers, best first
    factor: str  # what decided: a term of deciding_factor, or the policy's own reason


class RoutingPolicy(Protocol):
    @property
    def name(self) -> str:
        """The policy's name in settings (`[scoring] policy`) and reports."""

    @property
    def weights(self) -> ScoringSettings:
        """The scoring settings it ranks with (also the prefill rate and KV size that
        price a disaggregated request's legs)."""

    def rank(
        self, request: RequestFacts, workers: CandidateFacts, rng: np.random.Generator
    ) -> Ranking:
        """The eligible `workers`, best first; randomness (ties) from `rng` only."""


class KvplaneScoring:
    """kvplane's policy: the highest score of router/scoring/score.py first."""

    name = "kvplane"

    def __init__(self, weights: ScoringSettings) -> None:
        self.weights = weights
        self._hit_values = hit_values(weights)

    def rank(
        self, request: RequestFacts, workers: CandidateFacts, rng: np.random.Generator
    ) -> Ranking:
        scores = score_candidates(request, workers, self.weights, self._hit_values)
        ranked = rank_by_score(scores, rng)
        return Ranking(ranked, deciding_factor(ranked))


class RoundRobin:
    """The baseline: eligible workers take turns in worker-id order, whatever their
    scores (still computed, so that a decision is explained as kvplane's would be)."""

    name = "round-robin"

    def __init__(self, weights: ScoringSettings) -> None:
        self.weights = weights
        self._turn = itertools.count()

    def rank(
        self, request: RequestFacts, workers: CandidateFacts, rng: np.random.Generator
    ) -> Ranking:
        scores = score_candidates(request, workers, self.weights)
        rows = sorted(np.flatnonzero(scores.eligible).tolist(), key=workers.worker_ids.__getitem__)
        if not rows:  # no turn taken: the next eligible worker is still next
            nobody = RankedWorkers(scores, np.array(rows, dtype=np.intp))
            return Ranking(nobody, deciding_factor(nobody))
        turn = next(self._turn) % len(rows)
        return Ranking(
            RankedWorkers(scores, np.array(rows[turn:] + rows[:turn], dtype=np.intp)),
            "round_robin",
        )


POLICIES: Mapping[str, Callable[[ScoringSettings], RoutingPolicy]] = {
    KvplaneScoring.name: KvplaneScoring,
    RoundRobin.name: RoundRobin,
}
"""Every policy `[scoring] policy` may name, by name."""


def configured_policy(weights: ScoringSettings) -> RoutingPolicy:
    """The policy the settings name, with their weights."""
    return POLICIES[weights.policy](weights)
