"""What each tenant got in a cell with tenants that compete (the `noisy-tenant`
situation): its latency by group, the requests the router shed and why, the throughput
over the schedule, and each tenant's share of the service while it was backlogged.

Service is what kvplane's flow control charges a tenant for (`FlowControlSettings`'
defaults): a prompt token the engine computed (not cached) costs 1, a generated token 2
and 0.01 a token of the context it holds (router/flow_control/gate.py `answer_cost`).
A request's prompt is served when its first token arrives, its answer token by token
until its end.

A tenant is *backlogged* while one of its requests has waited longer than
`BACKLOG_WAIT_S` for its first token (or for its 429): long past what serving it takes
on a fleet with room, so it is waiting behind others. A tenant's share while backlogged
is its service over everyone's in the windows where it was; the tenants' shares while
all of them were backlogged are what a fair scheduler divides by the configured shares.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from benchmarks.live.client import Outcome
from kvplane.core.config import FlowControlSettings
from router.flow_control.gate import answer_cost
from simulations.reporting import percentile

# About twice the well-behaved tenants' solo TTFT p99 behind kvplane (1.6 s on the
# noisy-tenant fleet, `docs/benchmarks.md`): a request that waits longer than this waits
# in a queue, not for its own prefill.
BACKLOG_WAIT_S = 3.0
_COSTS = FlowControlSettings()
INPUT_TOKEN_COST = _COSTS.input_token_cost
NOISY_GROUP, WELL_BEHAVED_GROUP = "noisy", "well-behaved"

Interval = tuple[float, float]  # [start, end), seconds from the cell's start


@dataclass(slots=True)
class TenantFigures:
    """One cell's figures by tenant; in the JSON as they are here."""

    # TTFT percentiles by group ("well-behaved": every tenant but the noisy one, pooled;
    # "noisy"; each tenant where none is noisy), ms: {"p50": ..., "p90": ..., "p99": ...};
    # a request never answered (failed, or cancelled at the cell's end) counts as an
    # infinite TTFT, one shed as none. And those never answered, by group.
    ttft_ms_by_group: dict[str, dict[str, float]] = field(default_factory=dict)
    failed_by_group: dict[str, int] = field(default_factory=dict)
    # The share of the prompt tokens of each group's answered requests that their
    # engines reported cached: the cell's hit rate weighs each group by its prompts, so
    # it moves with how many of the noisy tenant's long ones were answered.
    hit_rate_by_group: dict[str, float] = field(default_factory=dict)
    shed_by_tenant: dict[str, dict[str, int]] = field(default_factory=dict)  # reason: count
    # Over the schedule (the first request's start to the last one's): requests answered
    # and their output tokens, a second.
    span_requests_per_s: float = 0.0
    span_output_tokens_per_s: float = 0.0
    backlogged_s: dict[str, float] = field(default_factory=dict)
    backlogged_share: dict[str, float] = field(default_factory=dict)  # of the service then
    all_backlogged_s: float = 0.0  # every tenant backlogged at once
    all_backlogged_shares: dict[str, float] = field(default_factory=dict)
    configured_shares: dict[str, float] = field(default_factory=dict)  # normalised to 1

    @property
    def shed(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.shed_by_tenant.values())

    @property
    def share_errors(self) -> dict[str, float]:
        """Each tenant's measured share while all were backlogged over its configured
        share, less 1 (0.1: 10% more than configured); empty without that window."""
        if not self.all_backlogged_shares:
            return {}
        return {
            tenant: self.all_backlogged_shares.get(tenant, 0.0) / configured - 1
            for tenant, configured in self.configured_shares.items()
        }


def group_of(tenant: str | None, noisy: str | None) -> str:
    """The noisy tenant's group or the well-behaved tenants'; with no noisy tenant,
    each tenant's own."""
    if noisy is None:
        return tenant or ""
    return NOISY_GROUP if tenant == noisy else WELL_BEHAVED_GROUP


def tenant_figures(
    outcomes: Sequence[Outcome],
    *,
    started_at: float,
    span_s: float,
    tenants: Sequence[str],
    noisy: str | None,
    shares: dict[str, float],
) -> TenantFigures:
    """The figures of a cell whose traffic began at `started_at` (wall clock) and whose
    schedule lasted `span_s`; `noisy`: the noisy tenant, if one is; `shares`: the
    configured ones (a tenant not named: 1)."""
    figures = TenantFigures()
    ttfts: dict[str, list[float]] = {}
    for outcome in outcomes:
        group = group_of(outcome.tenant, noisy)
        if outcome.ttft_s is not None:
            ttfts.setdefault(group, []).append(outcome.ttft_s)
        elif not outcome.shed:
            # Overloaded, a router leaves requests unanswered: left out, they would
            # flatter its tail.
            ttfts.setdefault(group, []).append(math.inf)
            figures.failed_by_group[group] = figures.failed_by_group.get(group, 0) + 1
    figures.ttft_ms_by_group = {
        group: {f"p{round(q * 100)}": percentile(samples, q) * 1000 for q in (0.5, 0.9, 0.99)}
        for group, samples in sorted(ttfts.items(), key=lambda item: item[0] == NOISY_GROUP)
    }
    figures.hit_rate_by_group = hit_rates(outcomes, noisy)
    for outcome in outcomes:
        if outcome.shed_reason is not None:
            reasons = figures.shed_by_tenant.setdefault(outcome.tenant or "", {})
            reasons[outcome.shed_reason] = reasons.get(outcome.shed_reason, 0) + 1
    ended = [o for o in outcomes if o.ok and _end(o, started_at) <= span_s]
    if span_s > 0:
        figures.span_requests_per_s = len(ended) / span_s
        figures.span_output_tokens_per_s = sum(o.output_tokens for o in ended) / span_s
    waiting = backlogged(outcomes, started_at)
    for tenant in tenants:
        windows = waiting.get(tenant, [])
        figures.backlogged_s[tenant] = length(windows)
        if windows:
            served = service_shares(outcomes, started_at, windows)
            figures.backlogged_share[tenant] = served.get(tenant, 0.0)
    everyone = all_backlogged([waiting.get(tenant, []) for tenant in tenants])
    figures.all_backlogged_s = length(everyone)
    if everyone:
        figures.all_backlogged_shares = service_shares(outcomes, started_at, everyone)
    configured = {tenant: shares.get(tenant, 1.0) for tenant in tenants}
    figures.configured_shares = {
        tenant: share / sum(configured.values()) for tenant, share in configured.items()
    }
    return figures


def hit_rates(outcomes: Iterable[Outcome], noisy: str | None) -> dict[str, float]:
    """Each group's cached prompt tokens over its prompt tokens, answered requests only."""
    prompt: dict[str, int] = {}
    cached: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.ok and outcome.prompt_tokens > 0:
            group = group_of(outcome.tenant, noisy)
            prompt[group] = prompt.get(group, 0) + outcome.prompt_tokens
            cached[group] = cached.get(group, 0) + outcome.cached_tokens
    return {group: cached[group] / tokens for group, tokens in prompt.items()}


def backlogged(
    outcomes: Iterable[Outcome], started_at: float, wait_s: float = BACKLOG_WAIT_S
) -> dict[str, list[Interval]]:
    """Each tenant's backlogged windows: from `wait_s` after a request was sent until
    its first token or its 429, for each request that waited longer, merged."""
    spans: dict[str, list[Interval]] = {}
    for outcome in outcomes:
        waited = outcome.ttft_s if outcome.ttft_s is not None else outcome.latency_s
        if outcome.tenant is None or waited is None or waited <= wait_s:
            continue
        sent = outcome.sent_at - started_at
        spans.setdefault(outcome.tenant, []).append((sent + wait_s, sent + waited))
    return {tenant: union(intervals) for tenant, intervals in spans.items()}


def all_backlogged(windows: Sequence[list[Interval]]) -> list[Interval]:
    """Where every tenant's windows overlap."""
    if not windows:
        return []
    common = windows[0]
    for other in windows[1:]:
        common = intersect(common, other)
    return common


def service_shares(
    outcomes: Iterable[Outcome], started_at: float, windows: list[Interval]
) -> dict[str, float]:
    """Each tenant's share of the service served inside `windows` (0 where none was)."""
    served: dict[str, float] = {}
    for outcome in outcomes:
        if outcome.tenant is not None and outcome.ok:
            served[outcome.tenant] = served.get(outcome.tenant, 0.0) + service_within(
                outcome, started_at, windows
            )
    total = sum(served.values())
    return {tenant: value / total if total else 0.0 for tenant, value in served.items()}


def service_within(outcome: Outcome, started_at: float, windows: list[Interval]) -> float:
    """The service of an answered request that falls inside `windows`: its computed
    prompt tokens when its first token came, its answer's tokens evenly until its end."""
    if outcome.ttft_s is None or outcome.latency_s is None:
        return 0.0
    first = outcome.sent_at - started_at + outcome.ttft_s
    end = outcome.sent_at - started_at + outcome.latency_s
    computed = outcome.prompt_tokens - outcome.cached_tokens
    served = INPUT_TOKEN_COST * computed if _inside(first, windows) else 0.0
    answer = answer_cost(_COSTS, outcome.prompt_tokens, outcome.output_tokens)
    if end > first:
        served += answer * overlap((first, end), windows) / (end - first)
    elif _inside(end, windows):
        served += answer
    return served


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, overlapping and touching intervals merged."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(first: list[Interval], second: list[Interval]) -> list[Interval]:
    """Where two sorted, disjoint interval lists overlap."""
    common = []
    i = j = 0
    while i < len(first) and j < len(second):
        start = max(first[i][0], second[j][0])
        end = min(first[i][1], second[j][1])
        if start < end:
            common.append((start, end))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return common


def overlap(span: Interval, windows: list[Interval]) -> float:
    return sum(max(0.0, min(span[1], end) - max(span[0], start)) for start, end in windows)


def length(windows: list[Interval]) -> float:
    return sum(end - start for start, end in windows)


def _inside(moment: float, windows: list[Interval]) -> bool:
    return any(start <= moment < end for start, end in windows)


def _end(outcome: Outcome, started_at: float) -> float:
    return outcome.sent_at - started_at + (outcome.latency_s or 0.0)
