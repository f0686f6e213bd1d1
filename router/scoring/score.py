"""Scoring workers for one request: a pure function of what the router knows.

Every term is in the same unit, prefill tokens: what sending the request to a worker
saves (its cached prefix, each tier's hit worth what restoring it saves over
recomputing it) minus what it costs there (the queue ahead of it, the evictions its new
blocks would cause on a nearly full or turning-over cache, the copy it would make of a
prefix another worker holds, the tenant risk of its company). The highest score wins;
ties are broken at random, never by list order. Every score can be broken down into its
terms, so that the decision can be explained.

The facts and the scores are columns, one row per candidate worker: a fleet of a
thousand workers is scored in a few numpy operations, not a thousand Python calls, and
a score's breakdown is built only for the workers a request reads (the first few of the
ranking, or all of them for an operator's locality query).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, overload

import numpy as np
import numpy.typing as npt

from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier

Column = npt.NDArray[np.float64]
Flags = npt.NDArray[np.bool_]

TIERS = tuple(Tier)
"""The order of CandidateFacts.matched_tokens' columns."""
_DEVICE = TIERS.index(Tier.DEVICE)


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


class CandidateFacts(NamedTuple):
    """What the router knows of its candidate workers when it decides, as columns: row
    i of every column is worker_ids[i]. The columns are float64, whatever they count,
    so that scoring never converts them."""

    worker_ids: Sequence[str]
    matched_tokens: npt.NDArray[np.float64]  # (rows, len(TIERS)): cached prefix per tier
    waiting_requests: Column
    running_requests: Column
    # Waiting and running come from the worker's own load report (True), or only from
    # this router's requests (False: its agent streams to another router replica).
    load_reported: Flags
    queued_prefill_tokens: Column  # prompt tokens still to prefill ahead of this request
    kv_usage: Column  # the engine's: blocks its running requests hold
    evicted_share: Column  # of its cache, evicted lately (router/routing/evictions.py)
    other_tenants_running: Column
    suspect: Flags  # its index entries keep failing: its matches count for nothing
    labels: Sequence[Mapping[str, str]]
    pools: npt.NDArray[np.object_]  # a dedicated tenant's pool each belongs to, or None
    max_model_len: Column  # the longest prompt plus output its engine takes; inf: unknown
    # Workers that cannot take this request, or this leg of it (a prefill-only worker,
    # for a whole request); None: none excluded.
    excluded: Flags | None = None


@dataclass(frozen=True, slots=True)
class RequestFacts:
    prompt_tokens: int  # estimated, while the rest of a prompt is not tokenised yet
    isolation: str = "shared"  # shared | private | dedicated
    required_labels: Mapping[str, str] = field(default_factory=dict)
    pool: str | None = None  # for `dedicated`: the only pool it may use
    # Whether prompt_tokens counts the prompt as the engines do: only then is it held
    # against each worker's max_model_len (not while an engine tokenises otherwise).
    counted_as_engines: bool = True
    # The most tokens the prompt can have (None: prompt_tokens, counted exactly).
    prompt_tokens_at_most: int | None = None


Term = TypeVar("Term", float, Column)


def net_score(saved: Term, queue: Term, memory: Term, copy: Term, tenant: Term) -> Term:
    """What a worker saves less what it costs there: one worker's (floats) or every
    candidate's (columns)."""
    return saved - queue - memory - copy - tenant


class ScoreBreakdown(NamedTuple):
    worker_id: str
    cached_tokens: int  # the longest matched prefix, any tier
    saved_tokens: float
    queue_penalty: float
    memory_penalty: float
    tenant_penalty: float
    spilled: bool = False  # far busier than the fleet: its queue penalty has the spill
    copy_penalty: float = 0.0
    copied_tokens: int = 0  # of its new tokens, those another eligible worker holds

    @property
    def score(self) -> float:
        return net_score(
            self.saved_tokens,
            self.queue_penalty,
            self.memory_penalty,
            self.copy_penalty,
            self.tenant_penalty,
        )


class Scores(NamedTuple):
    """Every candidate's score, term by term, as columns (rows as CandidateFacts')."""

    worker_ids: Sequence[str]
    cached_tokens: Column
    saved_tokens: Column
    queue_penalty: Column
    memory_penalty: Column
    tenant_penalty: Column
    eligible: Flags
    spilled: Flags
    copy_penalty: Column
    # The longest prefix a believed eligible worker holds: a worker's tokens short of
    # it are a copy (its breakdown's copied_tokens).
    held_elsewhere: float

    @property
    def total(self) -> Column:
        return net_score(
            self.saved_tokens,
            self.queue_penalty,
            self.memory_penalty,
            self.copy_penalty,
            self.tenant_penalty,
        )

    def breakdown(self, row: int) -> ScoreBreakdown:
        return ScoreBreakdown(
            self.worker_ids[row],
            int(self.cached_tokens[row]),
            float(self.saved_tokens[row]),
            float(self.queue_penalty[row]),
            float(self.memory_penalty[row]),
            float(self.tenant_penalty[row]),
            bool(self.spilled[row]),
            float(self.copy_penalty[row]),
            int(max(self.held_elsewhere - self.cached_tokens[row], 0.0)),
        )


def queue_estimate(
    reported: Flags,
    report: tuple[Column, Column],
    sent_since_report: Column,
    in_flight: Column,
    prefilling: Column,
) -> tuple[Column, Column]:
    """Waiting and running requests at each worker, as a router can tell: the worker's
    last report (waiting, running) plus this router's requests sent since, which the
    report cannot have counted; without a report (`reported` false), this router's own
    requests (those before their first byte wait, the others run)."""
    waiting, running = report
    decoding = in_flight - prefilling
    return (
        np.where(reported, waiting + sent_since_report, prefilling),
        np.where(reported, np.maximum(running, decoding), decoding),
    )


def eligible(request: RequestFacts, facts: CandidateFacts) -> Flags:
    """The workers that can take the request: `dedicated` is a hard filter (only the
    tenant's own pool), no worker takes a prompt over its max_model_len, and none that
    the facts exclude."""
    rows = len(facts.worker_ids)
    if request.counted_as_engines:
        most = request.prompt_tokens_at_most
        allowed = facts.max_model_len >= (request.prompt_tokens if most is None else most)
    else:
        allowed = np.ones(rows, dtype=np.bool_)
    if facts.excluded is not None:
        allowed = allowed & ~facts.excluded
    if request.isolation != "dedicated":
        return allowed
    if request.pool is None:
        return np.zeros(rows, dtype=np.bool_)
    return allowed & np.asarray(facts.pools == request.pool, dtype=np.bool_)


def spill_excess(
    load: Column, eligible: Flags, reported: Flags, weights: ScoringSettings
) -> Column:
    """For each eligible worker whose load (requests waiting and running) is over the
    mean of its peers by both `spill_margin_requests` and `spill_load_ratio` times, its
    requests over that mean; 0 for the others. A worker's peers are the eligible workers
    whose load is known the same way (`reported`): a router replica sees of the others
    only its own requests, which would make every reported worker look crowded."""
    excess = np.zeros(len(load))
    if weights.spill_margin_requests <= 0 or weights.spill_request_tokens <= 0:
        return excess
    # The gate is never below the margin (a mean load is never negative): while no
    # worker has more requests than that, one comparison settles it, where the peers'
    # means below cost a decision about 6 µs of numpy calls.
    if not len(load) or load.max() <= weights.spill_margin_requests:
        return excess
    for peers in (eligible & reported, eligible & ~reported):
        if not peers.any():
            continue
        mean = float(load[peers].mean())
        if not np.isfinite(mean):
            continue
        threshold = max(mean + weights.spill_margin_requests, mean * weights.spill_load_ratio)
        excess = np.where(peers & (load > threshold), load - mean, excess)
    return excess


def hit_values(weights: ScoringSettings) -> Column:
    """hit_value of every tier, in TIERS' order: constant for a policy's weights."""
    return np.array([hit_value(tier, weights) for tier in TIERS])


def score_candidates(
    request: RequestFacts,
    facts: CandidateFacts,
    weights: ScoringSettings,
    values: Column | None = None,
) -> Scores:
    """Every candidate's score; `values`: hit_values(weights), if the caller keeps them."""
    prompt = float(request.prompt_tokens)
    values = hit_values(weights) if values is None else values
    cached = np.minimum(facts.matched_tokens.sum(axis=1), prompt)
    allowed = eligible(request, facts)
    saved = np.where(facts.suspect, 0.0, np.minimum(facts.matched_tokens @ values, prompt))
    load = facts.waiting_requests + facts.running_requests
    excess = spill_excess(load, allowed, facts.load_reported, weights)
    spill = np.minimum(excess * weights.spill_request_tokens, weights.spill_max_tokens)
    queue = (
        facts.waiting_requests * weights.waiting_request_tokens
        + facts.running_requests * weights.running_request_tokens
        + facts.queued_prefill_tokens * weights.queued_prefill_weight
        + spill
    )
    spilled = excess > 0
    start = weights.memory_pressure_start
    usage_pressure = (facts.kv_usage - start) / max(1.0 - start, 1e-9)
    # A cache that is turning over evicts prefixes still in use, whatever its usage.
    # np.minimum and np.maximum, not np.clip: its Python wrapper costs more than both.
    pressure = np.minimum(np.maximum(np.maximum(usage_pressure, facts.evicted_share), 0.0), 1.0)
    # Every token not on the worker's device takes a device block there, restored from
    # a slower tier or computed: what a hit on a slower tier saves is its tier credit
    # alone. Of those tokens, the ones no tier of this worker holds and another eligible
    # worker does are a copy, priced apart.
    believed = allowed & ~facts.suspect  # a suspect worker's entries count for nothing
    held_elsewhere = float(np.max(cached, where=believed, initial=0.0))
    if pressure.any():
        on_device = np.minimum(facts.matched_tokens[:, _DEVICE], prompt)
        copied = np.maximum(held_elsewhere - cached, 0.0)
        memory = pressure * (prompt - on_device - copied) * weights.memory_pressure_weight
        copy = pressure * copied * weights.copy_pressure_weight
    else:  # a calm fleet (the common case): no eviction to price, and no numpy to spend
        memory = copy = np.zeros(len(cached))
    tenant = np.zeros(len(facts.worker_ids))
    if request.isolation == "private":
        tenant += facts.other_tenants_running * weights.co_residence_tokens
        if request.required_labels:
            missing = [
                sum(1 for key, value in request.required_labels.items() if labels.get(key) != value)
                for labels in facts.labels
            ]
            tenant += np.array(missing, dtype=np.float64) * weights.missing_label_tokens
    return Scores(
        facts.worker_ids,
        cached,
        saved,
        queue,
        memory,
        tenant,
        allowed,
        spilled,
        copy,
        held_elsewhere,
    )


class RankedWorkers(Sequence[ScoreBreakdown]):
    """Workers best first, read as score breakdowns; a breakdown is built when read (a
    request reads the first few of a fleet of thousands). Equal to any sequence of the
    same breakdowns."""

    def __init__(self, scores: Scores, rows: npt.NDArray[np.intp]) -> None:
        self.scores = scores
        self.rows = rows  # into the scores' columns, best first

    def __len__(self) -> int:
        return len(self.rows)

    def worker_id(self, position: int) -> str:
        """The worker at `position`, without building its breakdown."""
        return self.scores.worker_ids[int(self.rows[position])]

    @overload
    def __getitem__(self, position: int) -> ScoreBreakdown: ...

    @overload
    def __getitem__(self, position: slice) -> list[ScoreBreakdown]: ...

    def __getitem__(self, position: int | slice) -> ScoreBreakdown | list[ScoreBreakdown]:
        if isinstance(position, slice):
            return [self.scores.breakdown(int(row)) for row in self.rows[position]]
        return self.scores.breakdown(int(self.rows[position]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"RankedWorkers({self[:]!r})"


def rank_by_score(scores: Scores, rng: np.random.Generator) -> RankedWorkers:
    """Eligible workers, best first; equal scores in random order (a shared system
    prompt matches everywhere, and list order would send it all to one worker)."""
    rows = np.flatnonzero(scores.eligible)
    tiebreak = rng.random(len(rows))
    # lexsort: by the last key first, ascending; reversed, the best score comes first.
    order = np.lexsort((tiebreak, scores.total[rows]))[::-1]
    return RankedWorkers(scores, rows[order])


def deciding_factor(ranked: Sequence[ScoreBreakdown]) -> str:
    """The term that set the winner furthest apart from the runner-up: `cache`, `load`
    (`spill` when the runner-up was past the spill gate), `memory`, `copy` (the
    runner-up would have copied a prefix the winner holds into a cache under pressure)
    or `tenant`; `only_choice` with one worker, `tie` when nothing did."""
    if not ranked:
        return "none"
    if len(ranked) == 1:
        return "only_choice"
    best, second = ranked[0], ranked[1]
    margins = {
        "cache": best.saved_tokens - second.saved_tokens,
        "load": second.queue_penalty - best.queue_penalty,
        "memory": second.memory_penalty - best.memory_penalty,
        "copy": second.copy_penalty - best.copy_penalty,
        "tenant": second.tenant_penalty - best.tenant_penalty,
    }
    factor, margin = max(margins.items(), key=lambda item: item[1])
    if margin <= 0:
        return "tie"
    if factor == "load" and second.spilled and not best.spilled:
        return "spill"  # the runner-up was past the spill gate
    return factor
