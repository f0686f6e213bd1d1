"""The cache-loss funnel: of a request's prompt tokens, how many the fleet held anywhere
(attainable), how many on the worker it went to (predicted), how many that engine
reported cached (achieved), and why each stage lost what it lost.

Two losses name what an operator can act on: tokens the fleet had held and evicted
(its caches are too small for its working set), and tokens copied, prefilled on a
worker while another held them (load spread a prefix over several engines).

A request's step through the funnel is a pure function of what the router decided and
what the engine answered (`funnel_step`); `CacheFunnel` adds the steps up per model and
tenant, and per worker, for the metrics, the fleet API and its page. Tokens, never text.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


# StrEnums, not Enums: the stages and losses key the dicts every answered request adds
# up, and an Enum hashes in Python (its name), a StrEnum as its str does.
class Stage(enum.StrEnum):
    PROMPT = "prompt"  # the prompt's tokens, as the router counted them
    ATTAINABLE = "attainable"  # the longest prefix any candidate worker held
    PREDICTED = "predicted"  # the prefix the worker it went to held
    ACHIEVED = "achieved"  # what that engine reported cached


class Loss(enum.StrEnum):
    """Why a stage holds fewer tokens than the one before it."""

    # prompt, not attainable: the blocks right after the attainable prefix were removed
    # from a worker's device tier lately (the rest of the gap: never held, or long ago)
    EVICTED_FROM_FLEET = "evicted_from_fleet"
    # attainable, not predicted: a worker holding more was passed over ...
    ROUTED_FOR_LOAD = "routed_for_load"  # ... for its load or other penalties
    HOLDER_UNAVAILABLE = "holder_unavailable"  # ... being ineligible (max_model_len, pool)
    # predicted, not achieved:
    TIER_RESTORE = "tier_restore"  # held on a slower tier, not restored as cached
    EVICTED_BEFORE_ARRIVAL = "evicted_before_arrival"  # the engine evicted blocks meanwhile
    PREDICTION_WRONG = "prediction_wrong"  # the engine did not hold what was believed
    UNREPORTED = "unreported"  # the engine reports no cached tokens: not measured


@dataclass(frozen=True, slots=True)
class FunnelStep:
    """One answered request's way through the funnel."""

    stages: Mapping[Stage, int]  # ACHIEVED is absent when the engine did not report
    losses: Mapping[Loss, int]


def funnel_step(
    *,
    prompt_tokens: int,
    attainable_tokens: int,
    predicted_tokens: int,
    predicted_off_device_tokens: int,
    holder_eligible: bool,
    achieved_tokens: int | None,
    evicted_meanwhile: bool,
    evicted_from_fleet_tokens: int,
) -> FunnelStep:
    """`attainable_tokens`: the most any candidate held; `holder_eligible`: whether a
    worker holding that much was eligible; `predicted_off_device_tokens`: the part of
    the prediction on host, disk or remote tiers; `achieved_tokens`: the engine's
    report (None: it sent none); `evicted_meanwhile`: the worker evicted blocks between
    the request's dispatch and its answer; `evicted_from_fleet_tokens`: of the tokens
    past `attainable_tokens`, the ones right after it that the fleet removed from its
    device tiers lately (the caller's count, at most prompt less attainable)."""
    stages = {
        Stage.PROMPT: prompt_tokens,
        Stage.ATTAINABLE: attainable_tokens,
        Stage.PREDICTED: predicted_tokens,
    }
    losses: dict[Loss, int] = {}
    if evicted_from_fleet_tokens > 0:
        losses[Loss.EVICTED_FROM_FLEET] = evicted_from_fleet_tokens
    passed_over = attainable_tokens - predicted_tokens
    if passed_over > 0:
        losses[Loss.ROUTED_FOR_LOAD if holder_eligible else Loss.HOLDER_UNAVAILABLE] = passed_over
    if achieved_tokens is None:
        if predicted_tokens:
            losses[Loss.UNREPORTED] = predicted_tokens
        return FunnelStep(stages, losses)
    stages[Stage.ACHIEVED] = achieved_tokens
    missing = predicted_tokens - achieved_tokens
    if missing > 0:
        off_device = min(missing, predicted_off_device_tokens)
        if off_device:
            losses[Loss.TIER_RESTORE] = off_device
        if missing > off_device:
            reason = Loss.EVICTED_BEFORE_ARRIVAL if evicted_meanwhile else Loss.PREDICTION_WRONG
            losses[reason] = missing - off_device
    return FunnelStep(stages, losses)


@dataclass(slots=True)
class FunnelTotals:
    requests: int = 0
    stages: dict[Stage, int] = field(default_factory=lambda: dict.fromkeys(Stage, 0))
    losses: dict[Loss, int] = field(default_factory=lambda: dict.fromkeys(Loss, 0))
    reported_requests: int = 0  # whose engine reported its cached tokens
    reported_prompt_tokens: int = 0  # their prompt tokens: what ACHIEVED is a share of
    reported_predicted_tokens: int = 0  # their PREDICTED: what ACHIEVED is checked against

    def add(self, step: FunnelStep) -> None:
        self.requests += 1
        for stage, tokens in step.stages.items():
            self.stages[stage] += tokens
        for loss, tokens in step.losses.items():
            self.losses[loss] += tokens
        if Stage.ACHIEVED in step.stages:
            self.reported_requests += 1
            self.reported_prompt_tokens += step.stages[Stage.PROMPT]
            self.reported_predicted_tokens += step.stages[Stage.PREDICTED]

    @property
    def copied_tokens(self) -> int:
        """Duplication: tokens prefilled on a worker while another held them (passed over
        for its load, or ineligible), which the fleet then holds twice."""
        return self.losses[Loss.ROUTED_FOR_LOAD] + self.losses[Loss.HOLDER_UNAVAILABLE]


class CacheFunnel:
    """Totals since start per (model, tenant), and per worker while it is in the pool:
    models are the workers' registered ones and tenants the configured ones, so the keys
    stay few."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], FunnelTotals] = {}
        self._by_worker: dict[str, FunnelTotals] = {}

    def add(self, model: str, tenant: str, worker_id: str, step: FunnelStep) -> None:
        # (setdefault would build and drop a FunnelTotals a request)
        totals = self._totals.get((model, tenant))
        if totals is None:
            totals = self._totals[model, tenant] = FunnelTotals()
        totals.add(step)
        worker = self._by_worker.get(worker_id)
        if worker is None:
            worker = self._by_worker[worker_id] = FunnelTotals()
        worker.add(step)

    def totals(self) -> dict[tuple[str, str], FunnelTotals]:
        return dict(self._totals)

    def worker_totals(self, worker_id: str) -> FunnelTotals | None:
        return self._by_worker.get(worker_id)

    def retain_workers(self, worker_ids: Iterable[str]) -> None:
        """Forget the workers that left the fleet (their restarts keep their totals)."""
        keep = set(worker_ids)
        for gone in self._by_worker.keys() - keep:
            del self._by_worker[gone]
