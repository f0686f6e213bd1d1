"""Routing policies, each deciding from a RouterView only.

kvplane's and round-robin are the router's own policy objects (router/scoring/policy.py:
what `kvplane router` runs), driven by RouterPolicy, which gathers their inputs from
the view as router/routing/decide.py gathers them from a live fleet and books the
choice in the router's predicted entries (router/routing/predicted.py). The others are
baselines, and peers' policies come with their own modules: they read what the router's
CandidateFacts do not carry (in-flight counts, event-only prefixes, state of their own), so
they implement this module's Policy directly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier
from router.routing.decide import believed_blocks
from router.routing.evictions import RecentEvictions
from router.routing.predicted import PredictedPrefixes
from router.scoring.policy import POLICIES as ROUTER_POLICIES
from router.scoring.policy import RoutingPolicy
from router.scoring.score import TIERS, CandidateFacts, RequestFacts, queue_estimate
from simulations.fleet_sim.peer_policies import (
    DynamoPolicy,
    LlmdPolicy,
    PrefixSource,
    SglangCacheAwarePolicy,
    VllmRouterCacheAwarePolicy,
)
from simulations.fleet_sim.requests import TraceRequest
from simulations.fleet_sim.router_view import RouterView


class Policy(Protocol):
    name: str

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        """The worker (an index) to send the request to."""

    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        """Removals the view has just learnt of, from the worker's `tier` (policies with
        state of their own)."""


class _Stateless:
    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        return None


class RandomPolicy(_Stateless):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        return self.rng.randrange(view.workers)


class LeastLoadedPolicy(_Stateless):
    """Fewest requests in flight from this router; ties at random."""

    name = "least-loaded"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        loads = [traffic.in_flight for traffic in view.traffic]
        fewest = min(loads)
        return self.rng.choice([w for w, load in enumerate(loads) if load == fewest])


class LongestPrefixPolicy(_Stateless):
    """The worker whose events report the longest cached prefix; ties to the fewest
    requests in flight, then at random. Mooncake's routing for its local-cache figures
    (no load term: it is how far prefix affinity alone goes)."""

    name = "longest-prefix"

    def __init__(self, rng: random.Random, block_tokens: int) -> None:
        self.rng = rng
        self.block_tokens = block_tokens

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        blocks = request.blocks[: request.prompt_tokens // self.block_tokens]
        keys = [
            (view.matched_blocks(w, blocks), -view.traffic[w].in_flight)
            for w in range(view.workers)
        ]
        best = max(keys)
        return self.rng.choice([w for w, key in enumerate(keys) if key == best])


_DEVICE, _HOST = TIERS.index(Tier.DEVICE), TIERS.index(Tier.HOST)


def worker_id(worker: int) -> str:
    """A simulated worker's id for the router's policies: its index, zero-padded so
    that the ids sort as the indexes do (round-robin takes turns in id order)."""
    return f"{worker:06d}"


class RouterPolicy:
    """One of the router's policies deciding for the simulated router: the facts are
    gathered from the view, and the choice booked, as RoutingPlanner gathers and books
    them (each worker's blocks per tier, extended on the device by a prediction and cut
    to the servable blocks by the router's `believed_blocks`; the prompt's servable
    blocks predicted on the chosen worker)."""

    def __init__(
        self,
        policy: RoutingPolicy,
        rng: random.Random,
        block_tokens: int,
        predicted_ttl_s: float = 3.0,
        *,
        eviction_horizon_s: float = 0.0,
        capacity_blocks: int = 0,
    ) -> None:
        self.policy = policy
        self.name = policy.name
        self.rng = np.random.default_rng(rng.getrandbits(64))  # the policy's ties
        self.block_tokens = block_tokens
        self.predicted = PredictedPrefixes(predicted_ttl_s)
        self.evictions = RecentEvictions(eviction_horizon_s)
        self.capacity_blocks = capacity_blocks

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        full = request.prompt_tokens // self.block_tokens
        servable = max(0, request.prompt_tokens - 1) // self.block_tokens
        blocks = request.blocks[:full]
        self.predicted.prune(now)
        predicted = self.predicted.match(blocks, now)
        index_tiers = np.zeros((view.workers, len(TIERS)), dtype=np.int64)
        index_tiers[:, [_DEVICE, _HOST]] = [
            view.matched_by_tier(w, blocks) for w in range(view.workers)
        ]
        believed = believed_blocks(
            index_tiers,
            index_tiers.sum(axis=1),
            np.array([predicted.get(worker_id(w), 0) for w in range(view.workers)]),
            servable,
        )
        ranking = self.policy.rank(
            RequestFacts(prompt_tokens=request.prompt_tokens),
            self._facts(view, believed * self.block_tokens, now),
            self.rng,
        )
        chosen = int(ranking.ranked[0].worker_id)
        self.predicted.record(worker_id(chosen), blocks[:servable], now)
        return chosen

    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        """As the router hears removals: a prediction goes with its key on any tier; the
        eviction term counts the device's removals only."""
        if cleared:
            self.predicted.forget_worker(worker_id(worker))
            self.evictions.forget(worker_id(worker))
        elif removed:
            self.predicted.removed(worker_id(worker), removed)
            if tier is Tier.DEVICE:
                self.evictions.record(worker_id(worker), len(removed), now)

    def _facts(
        self, view: RouterView, matched_tokens: npt.NDArray[np.int64], now: float
    ) -> CandidateFacts:
        """The columns the router's Fleet.facts() keeps, read off the view;
        `matched_tokens`: per worker and tier (TIERS' order)."""
        reports = view.reports
        workers = len(matched_tokens)

        def column(values: Sequence[float]) -> npt.NDArray[np.float64]:
            return np.array(values, dtype=np.float64).reshape(workers)

        since = [
            0
            if report is None
            else sum(1 for sent, _ in t.prefilling.values() if sent > report.taken_at)
            for t, report in zip(view.traffic, reports, strict=True)
        ]
        reported = np.array([report is not None for report in reports], dtype=np.bool_)
        waiting, running = queue_estimate(
            reported,
            (
                column([0 if r is None else r.load.waiting for r in reports]),
                column([0 if r is None else r.load.running for r in reports]),
            ),
            column(since),
            column([traffic.in_flight for traffic in view.traffic]),
            column([len(traffic.prefilling) for traffic in view.traffic]),
        )
        ids = [worker_id(worker) for worker in range(workers)]
        evicted = [self.evictions.recorded(worker_id) for worker_id in ids]
        return CandidateFacts(
            worker_ids=ids,
            matched_tokens=matched_tokens.astype(np.float64),
            waiting_requests=waiting,
            running_requests=running,
            load_reported=reported,
            queued_prefill_tokens=column([traffic.prefill_tokens for traffic in view.traffic]),
            kv_usage=column([0.0 if r is None else r.load.kv_usage for r in reports]),
            evicted_share=self.evictions.shares(
                column([blocks for blocks, _ in evicted]),
                column([as_of for _, as_of in evicted]),
                np.full(workers, float(self.capacity_blocks)),
                now,
            ),
            other_tenants_running=np.zeros(workers),
            suspect=np.zeros(workers, dtype=np.bool_),
            labels=[{}] * workers,
            pools=np.full(workers, None, dtype=object),
            max_model_len=np.full(workers, np.inf),
        )


def make_policy(
    name: str,
    *,
    seed: int,
    block_tokens: int,
    capacity_tokens: int = 0,
    scoring: ScoringSettings | None = None,
) -> Policy:
    """The policy called `name`; `capacity_tokens` (per worker) sizes the estimated
    index of `llm-d-approximate`, `scoring` sets the router's policies' weights (default:
    their defaults)."""
    rng = random.Random(seed)
    if name in ROUTER_POLICIES:
        weights = scoring or ScoringSettings()
        return RouterPolicy(
            ROUTER_POLICIES[name](weights),
            rng,
            block_tokens,
            eviction_horizon_s=weights.eviction_horizon_s,
            capacity_blocks=capacity_tokens // block_tokens,
        )
    if name == "random":
        return RandomPolicy(rng)
    if name == "least-loaded":
        return LeastLoadedPolicy(rng)
    if name == "longest-prefix":
        return LongestPrefixPolicy(rng, block_tokens)
    # The peers' policies live apart, each following its published description.
    if name == "sglang-cache-aware":
        return SglangCacheAwarePolicy(rng, block_tokens)
    if name == "vllm-router-cache-aware":
        return VllmRouterCacheAwarePolicy(rng, block_tokens)
    if name == "dynamo":
        return DynamoPolicy(rng, block_tokens)
    llm_d_sources: dict[str, PrefixSource] = {
        policy_name: source for source, policy_name in LlmdPolicy.NAMES.items()
    }
    if name in llm_d_sources:
        return LlmdPolicy(
            rng,
            block_tokens,
            prefix_source=llm_d_sources[name],
            capacity_blocks=capacity_tokens // block_tokens,
        )
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")


POLICIES = (
    "random",
    "round-robin",
    "least-loaded",
    "longest-prefix",
    "sglang-cache-aware",
    "vllm-router-cache-aware",
    "llm-d-load",
    "llm-d-approximate",
    "llm-d-precise",
    "dynamo",
    "kvplane",
)
