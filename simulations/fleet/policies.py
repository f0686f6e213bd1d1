"""Routing policies, each deciding from a RouterView only.

kvplane's policy calls the router's own scoring (router/scoring/score.py: the function
`kvplane router` runs) and its predicted entries (router/routing/predicted.py); the
inputs are gathered from the view as router/routing/decide.py gathers them from a live
fleet. The others are baselines; peers' policies come with their own modules.
"""

from __future__ import annotations

import random
from typing import Protocol

from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier
from router.routing.predicted import PredictedPrefixes
from router.scoring.score import RequestFacts, WorkerFacts, queue_estimate, rank_workers
from simulations.fleet.peer_policies import (
    DynamoPolicy,
    LlmdPolicy,
    PrefixSource,
    SglangCacheAwarePolicy,
)
from simulations.fleet.requests import TraceRequest
from simulations.fleet.router_view import RouterView


class Policy(Protocol):
    name: str

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        """The worker (an index) to send the request to."""

    def events(self, worker: int, removed: list[int], cleared: bool) -> None:
        """Removals the view has just learnt of (policies with state of their own)."""


class _Stateless:
    def events(self, worker: int, removed: list[int], cleared: bool) -> None:
        return None


class RandomPolicy(_Stateless):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        return self.rng.randrange(view.workers)


class RoundRobinPolicy(_Stateless):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        worker, self._next = self._next, (self._next + 1) % view.workers
        return worker


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


class KvplanePolicy:
    name = "kvplane"

    def __init__(
        self,
        rng: random.Random,
        block_tokens: int,
        weights: ScoringSettings | None = None,
        predicted_ttl_s: float = 3.0,
    ) -> None:
        self.rng = rng
        self.block_tokens = block_tokens
        self.weights = weights or ScoringSettings()
        self.predicted = PredictedPrefixes(predicted_ttl_s)

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        full = request.prompt_tokens // self.block_tokens
        servable = max(0, request.prompt_tokens - 1) // self.block_tokens
        blocks = request.blocks[:full]
        self.predicted.prune(now)
        predicted = self.predicted.match(blocks, now)
        facts = []
        for worker in range(view.workers):
            matched = max(view.matched_blocks(worker, blocks), predicted.get(str(worker), 0))
            facts.append(self._facts(view, worker, min(matched, servable), now))
        ranked = rank_workers(
            RequestFacts(prompt_tokens=request.prompt_tokens), facts, self.weights, self.rng
        )
        chosen = int(ranked[0].worker_id)
        self.predicted.record(str(chosen), blocks[:servable], now)
        return chosen

    def events(self, worker: int, removed: list[int], cleared: bool) -> None:
        if cleared:
            self.predicted.forget_worker(str(worker))
        elif removed:
            self.predicted.removed(str(worker), removed)

    def _facts(self, view: RouterView, worker: int, matched: int, now: float) -> WorkerFacts:
        traffic = view.traffic[worker]
        report = view.reports[worker]
        since = 0
        if report is not None:
            since = sum(1 for sent, _ in traffic.prefilling.values() if sent > report.taken_at)
        waiting, running = queue_estimate(
            None if report is None else (report.load.waiting, report.load.running),
            since,
            traffic.in_flight,
            len(traffic.prefilling),
        )
        kv_usage = 0.0 if report is None else report.load.kv_usage
        return WorkerFacts(
            worker_id=str(worker),
            matched_tokens={Tier.DEVICE: matched * self.block_tokens} if matched else {},
            waiting_requests=waiting,
            running_requests=running,
            queued_prefill_tokens=traffic.prefill_tokens,
            kv_usage=kv_usage,
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
    index of `llm-d-approximate`, `scoring` sets kvplane's weights (default: its
    defaults)."""
    rng = random.Random(seed)
    if name == "random":
        return RandomPolicy(rng)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy(rng)
    if name == "longest-prefix":
        return LongestPrefixPolicy(rng, block_tokens)
    if name == "kvplane":
        return KvplanePolicy(rng, block_tokens, scoring)
    # The peers' policies live apart, each following its published description.
    if name == "sglang-cache-aware":
        return SglangCacheAwarePolicy(rng, block_tokens)
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
    "llm-d-load",
    "llm-d-approximate",
    "llm-d-precise",
    "dynamo",
    "kvplane",
)
