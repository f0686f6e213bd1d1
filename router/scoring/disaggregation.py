"""Pure: whether a request is split into a prefill leg and a decode leg, and the terms
that decided it (docs/pd-disaggregation.md).

The decode worker is chosen first, as for a whole request (its cached prefix, load and
memory). Then the request is served whole there, computing what the decode worker does
not hold after the prompts queued there, or split: the best prefill worker computes
what *it* does not hold after its own queue, and the decode worker pulls what it lacks.
Whichever costs less wins (`conditional`).

    whole = (queued on decode + uncached on decode
             x (1 + decode_stall_weight x streams running there)) / prefill rate
    split = (queued on prefill + uncached on prefill) / prefill rate
            + uncached on decode x KV bytes per token / link bandwidth + leg overhead

(Queued: prompt tokens of requests there still before their first token, as this
router knows them. A stream running on the decode worker stalls while it computes a
prompt, which is what disaggregation spares them.)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvplane.core.config import DisaggregationSettings, ScoringSettings
from kvplane.core.types import WorkerInfo, WorkerRole

ModelLegs = Literal["whole", "split", "no_prefill_worker", "no_decode_worker"]


class LegReason(enum.StrEnum):
    """Why a request was served whole or split (a metric label: a closed set)."""

    SPLIT_CHEAPER = "split_cheaper"
    WHOLE_CHEAPER = "whole_cheaper"
    ALWAYS = "always"  # `mode = always`
    NEVER = "never"  # `mode = never`
    NO_PREFILL_WORKER = "no_prefill_worker"  # decode workers, and no live prefill worker
    NO_DECODE_WORKER = "no_decode_worker"  # prefill workers only: they serve whole requests
    NO_TRANSFER = "no_transfer"  # the decode worker has no connector, or no peer shares it
    NO_PREFIX_GAIN = "no_prefix_gain"  # the prefill worker serves whole requests, holds no more


@dataclass(frozen=True, slots=True)
class LegPlan:
    """How a request is served: by `decode_worker` whole, or after `prefill_worker`'s
    leg; the costs compared (seconds; None where there was nothing to compare)."""

    decode_worker: str
    prefill_worker: str | None  # None: whole on decode_worker
    reason: LegReason
    whole_s: float | None = None
    split_s: float | None = None
    transfer_bytes: int = 0  # KV the decode worker pulls when split

    @property
    def split(self) -> bool:
        return self.prefill_worker is not None


@dataclass(frozen=True, slots=True)
class LegSide:
    """A worker's facts the plan reads."""

    worker_id: str
    cached_tokens: int  # of the prompt, believed held there
    queued_prefill_tokens: float  # of other requests there, before their first token
    running_requests: float
    takes_whole: bool = False  # it serves whole requests too (role both)


def plan_legs(
    prompt_tokens: int,
    decode: LegSide,
    prefill: LegSide | None,
    scoring: ScoringSettings,
    settings: DisaggregationSettings,
) -> LegPlan:
    """Whole or split, for a request of `prompt_tokens` whose decode worker is chosen;
    `prefill`: the best prefill worker that can hand its KV to that one (None: none)."""
    decode_id = decode.worker_id
    if prefill is None:
        return LegPlan(decode_id, None, LegReason.NO_TRANSFER)
    if settings.mode == "never":
        return LegPlan(decode_id, None, LegReason.NEVER)
    if (
        settings.mode == "conditional"
        and prefill.takes_whole
        and prefill.cached_tokens <= decode.cached_tokens
    ):
        # The ranking preferred the decode worker for the whole request over this one,
        # which holds no more of the prompt: splitting would only copy the prompt's KV
        # into a second cache (measured: the same 4 engines lost hit rate to it).
        return LegPlan(decode_id, None, LegReason.NO_PREFIX_GAIN)
    rate = scoring.prefill_tokens_per_s
    uncached_on_decode = max(0, prompt_tokens - decode.cached_tokens)
    uncached_on_prefill = max(0, prompt_tokens - prefill.cached_tokens)
    transfer_bytes = uncached_on_decode * scoring.kv_bytes_per_token
    stall = 1.0 + settings.decode_stall_weight * decode.running_requests
    whole_s = (decode.queued_prefill_tokens + uncached_on_decode * stall) / rate
    split_s = (
        (prefill.queued_prefill_tokens + uncached_on_prefill) / rate
        + transfer_bytes / settings.link_bytes_per_s
        + settings.leg_overhead_s
    )
    if settings.mode == "always":
        reason = LegReason.ALWAYS
    else:
        reason = LegReason.SPLIT_CHEAPER if split_s < whole_s else LegReason.WHOLE_CHEAPER
    chosen = None if reason is LegReason.WHOLE_CHEAPER else prefill.worker_id
    return LegPlan(decode_id, chosen, reason, whole_s, split_s, transfer_bytes)


def model_legs(live: Iterable[WorkerInfo]) -> dict[str, ModelLegs]:
    """Per model, from its live workers: whether its requests can be split (`split`:
    one worker takes prefill legs and another decode legs, with the same connector),
    are whole because no two of its workers can hand KV to each other (`whole`), or are
    whole because one side has no live worker."""
    prefill: dict[tuple[str, str], set[str]] = {}  # (model, connector) -> worker ids
    decode: dict[tuple[str, str], set[str]] = {}
    roles: dict[str, set[WorkerRole]] = {}
    for info in live:
        roles.setdefault(info.model, set()).add(info.role)
        group = (info.model, info.kv_connector)
        if info.transfers_kv and info.role is not WorkerRole.DECODE:
            prefill.setdefault(group, set()).add(info.worker_id)
        if info.transfers_kv and info.role is not WorkerRole.PREFILL:
            decode.setdefault(group, set()).add(info.worker_id)
    legs: dict[str, ModelLegs] = {}
    for model, model_roles in sorted(roles.items()):
        groups = [group for group in prefill.keys() | decode.keys() if group[0] == model]
        if model_roles == {WorkerRole.PREFILL}:
            legs[model] = "no_decode_worker"
        elif any(_pairs(prefill.get(group, set()), decode.get(group, set())) for group in groups):
            legs[model] = "split"
        elif WorkerRole.DECODE in model_roles and not any(prefill.get(g) for g in groups):
            legs[model] = "no_prefill_worker"
        else:
            legs[model] = "whole"
    return legs


def _pairs(prefill: set[str], decode: set[str]) -> bool:
    """Whether some worker of `prefill` can hand KV to another of `decode`."""
    return bool(prefill and decode) and len(prefill | decode) != 1
