"""Scoring workers for one request: a pure function of what the router knows.

Every term is in the same unit, prefill tokens: what sending the request to a worker
saves (its cached prefix, each tier's hit worth what restoring it saves over
recomputing it) minus what it costs there (the queue ahead of it, the evictions its new
blocks would cause on a nearly full or turning-over cache, the tenant risk of its
company). The highest score wins; ties are broken at random, never by list order. The
breakdown of every score is kept so that the decision can be explained.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier

_NO_LABELS: Mapping[str, str] = MappingProxyType({})

# WorkerFacts and ScoreBreakdown are NamedTuples: a decision builds one of each per
# worker, and a frozen dataclass costs several times as much to construct.


def hit_value(tier: Tier, weights: ScoringSettings) -> float:
    """A cache hit on `tier` as a fraction of a device hit: recomputing a token costs
    1 / prefill rate, restoring it costs its KV bytes / the tier's bandwidth; a hit saves
    the difference, never less than nothing."""
    if tier is Tier.DEVICE:
        return 1.0
    bandwidth = {
        Tier.HOST: weights.host_bandwidth_bytes_per_s,
        Tier.DISK: weights.disk_bandwidth_bytes_per_s,
        Tier.REMOTE: weights.remote_bandwidth_bytes_per_s,
    }[tier]
    if bandwidth <= 0:
        return 0.0
    restore_s = weights.kv_bytes_per_token / bandwidth
    return max(0.0, 1.0 - restore_s * weights.prefill_tokens_per_s)


class WorkerFacts(NamedTuple):
    """What the router knows of one worker when it decides."""

    worker_id: str
    matched_tokens: Mapping[Tier, int]  # cached prefix of this request, per tier
    waiting_requests: int = 0
    running_requests: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens still to prefill ahead of this request
    kv_usage: float = 0.0  # the engine's: blocks its running requests hold
    evicted_share: float = 0.0  # of its cache, evicted lately (router/routing/evictions.py)
    other_tenants_running: int = 0
    labels: Mapping[str, str] = _NO_LABELS
    pool: str | None = None  # a dedicated tenant's pool this worker belongs to
    suspect: bool = False  # its index entries keep failing: its matches count for nothing


@dataclass(frozen=True, slots=True)
class RequestFacts:
    prompt_tokens: int
    isolation: str = "shared"  # shared | private | dedicated
    required_labels: Mapping[str, str] = field(default_factory=dict)
    pool: str | None = None  # for `dedicated`: the only pool it may use


class ScoreBreakdown(NamedTuple):
    worker_id: str
    cached_tokens: int  # the longest matched prefix, any tier
    saved_tokens: float
    queue_penalty: float
    memory_penalty: float
    tenant_penalty: float

    @property
    def score(self) -> float:
        return self.saved_tokens - self.queue_penalty - self.memory_penalty - self.tenant_penalty


def queue_estimate(
    report: tuple[int, int] | None, sent_since_report: int, in_flight: int, prefilling: int
) -> tuple[int, int]:
    """Waiting and running requests at a worker, as a router can tell: the worker's
    last report (waiting, running) plus this router's requests sent since, which the
    report cannot have counted; without a report, this router's own requests (those
    before their first byte wait, the others run)."""
    if report is None:
        return prefilling, in_flight - prefilling
    waiting, running = report
    return waiting + sent_since_report, max(running, in_flight - prefilling)


def eligible(request: RequestFacts, worker: WorkerFacts) -> bool:
    """`dedicated` is a hard filter: only the tenant's own pool."""
    return request.isolation != "dedicated" or (
        request.pool is not None and worker.pool == request.pool
    )


def score_worker(
    request: RequestFacts, worker: WorkerFacts, weights: ScoringSettings
) -> ScoreBreakdown:
    cached = min(sum(worker.matched_tokens.values()), request.prompt_tokens)
    saved = sum(tokens * hit_value(tier, weights) for tier, tokens in worker.matched_tokens.items())
    saved = 0.0 if worker.suspect else min(saved, float(request.prompt_tokens))
    queue = (
        worker.waiting_requests * weights.waiting_request_tokens
        + worker.running_requests * weights.running_request_tokens
        + worker.queued_prefill_tokens * weights.queued_prefill_weight
    )
    start = weights.memory_pressure_start
    usage_pressure = (worker.kv_usage - start) / max(1.0 - start, 1e-9)
    # A cache that is turning over evicts prefixes still in use, whatever its usage.
    pressure = max(0.0, min(1.0, max(usage_pressure, worker.evicted_share)))
    memory = pressure * (request.prompt_tokens - cached) * weights.memory_pressure_weight
    tenant = 0.0
    if request.isolation == "private":
        tenant += worker.other_tenants_running * weights.co_residence_tokens
        missing = sum(
            1 for key, value in request.required_labels.items() if worker.labels.get(key) != value
        )
        tenant += missing * weights.missing_label_tokens
    return ScoreBreakdown(worker.worker_id, cached, saved, queue, memory, tenant)


def rank_workers(
    request: RequestFacts,
    workers: Sequence[WorkerFacts],
    weights: ScoringSettings,
    rng: random.Random,
) -> list[ScoreBreakdown]:
    """Eligible workers, best first; equal scores in random order (a shared system
    prompt matches everywhere, and list order would send it all to one worker)."""
    scored = [
        (breakdown.score, rng.random(), breakdown)
        for breakdown in (
            score_worker(request, worker, weights)
            for worker in workers
            if eligible(request, worker)
        )
    ]
    scored.sort(key=lambda entry: entry[:2], reverse=True)  # equal scores: random order
    return [breakdown for _, _, breakdown in scored]


def deciding_factor(ranked: Sequence[ScoreBreakdown]) -> str:
    """The term that set the winner furthest apart from the runner-up: `cache`, `load`,
    `memory` or `tenant`; `only_choice` with one worker, `tie` when nothing did."""
    if not ranked:
        return "none"
    if len(ranked) == 1:
        return "only_choice"
    best, second = ranked[0], ranked[1]
    margins = {
        "cache": best.saved_tokens - second.saved_tokens,
        "load": second.queue_penalty - best.queue_penalty,
        "memory": second.memory_penalty - best.memory_penalty,
        "tenant": second.tenant_penalty - best.tenant_penalty,
    }
    factor, margin = max(margins.items(), key=lambda item: item[1])
    return factor if margin > 0 else "tie"
