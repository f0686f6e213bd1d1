"""Routing policies: what turns the facts of one request and its candidate workers into
a ranking. The router's planner (router/routing/decide.py) and the fleet simulator
(simulations/fleet/policies.py) both hold one, gather the facts their own way, and act
on the ranking themselves.

A policy only decides (as the WorkerSelector of NVIDIA Dynamo's KV router): it reads
facts, draws from the caller's random generator, and returns workers best first with
their score breakdowns, so that every decision is explained the same way whatever the
policy. It books nothing: predicted entries and traffic are the caller's, recorded once
it has sent the request. The only state a policy keeps is its own cursor (round-robin's
turn).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import NamedTuple, Protocol

from kvplane.core.config import ScoringSettings
from router.scoring.score import (
    RequestFacts,
    ScoreBreakdown,
    WorkerFacts,
    deciding_factor,
    eligible,
    rank_workers,
    score_worker,
)


class Ranking(NamedTuple):
    ranked: list[ScoreBreakdown]  # the eligible workers, best first
    factor: str  # what decided: a term of deciding_factor, or the policy's own reason


class RoutingPolicy(Protocol):
    @property
    def name(self) -> str:
        """The policy's name in settings (`[scoring] policy`) and reports."""

    def rank(
        self, request: RequestFacts, workers: Sequence[WorkerFacts], rng: random.Random
    ) -> Ranking:
        """The eligible `workers`, best first; randomness (ties) from `rng` only."""


class KvplaneScoring:
    """kvplane's policy: the highest score of router/scoring/score.py first."""

    name = "kvplane"

    def __init__(self, weights: ScoringSettings) -> None:
        self.weights = weights

    def rank(
        self, request: RequestFacts, workers: Sequence[WorkerFacts], rng: random.Random
    ) -> Ranking:
        ranked = rank_workers(request, workers, self.weights, rng)
        return Ranking(ranked, deciding_factor(ranked))


class RoundRobin:
    """The baseline: eligible workers take turns in worker-id order, whatever their
    scores (still computed, so that a decision is explained as kvplane's would be)."""

    name = "round-robin"

    def __init__(self, weights: ScoringSettings) -> None:
        self.weights = weights
        self._turn = itertools.count()

    def rank(
        self, request: RequestFacts, workers: Sequence[WorkerFacts], rng: random.Random
    ) -> Ranking:
        ranked = sorted(
            (
                score_worker(request, worker, self.weights)
                for worker in workers
                if eligible(request, worker)
            ),
            key=attrgetter("worker_id"),
        )
        if not ranked:  # no turn taken: the next eligible worker is still next
            return Ranking(ranked, deciding_factor(ranked))
        turn = next(self._turn) % len(ranked)
        return Ranking(ranked[turn:] + ranked[:turn], "round_robin")


POLICIES: Mapping[str, Callable[[ScoringSettings], RoutingPolicy]] = {
    KvplaneScoring.name: KvplaneScoring,
    RoundRobin.name: RoundRobin,
}
"""Every policy `[scoring] policy` may name, by name."""


def configured_policy(weights: ScoringSettings) -> RoutingPolicy:
    """The policy the settings name, with their weights."""
    return POLICIES[weights.policy](weights)
