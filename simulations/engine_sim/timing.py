"""How long an engine step takes: a pure function of what the step computes.

Prefill costs time per uncached prompt token computed in the step plus a fixed overhead
for any step that prefills; each decode step costs a base time, plus time per decoding
request, plus time proportional to the total context they attend over. Defaults are
shaped like an 8B model on one H100 (about 12k prefill tokens/s, 10 ms decode steps at
small batches); simulations/fleet_sim/roofline.py derives one from a model's config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingModel:
    prefill_ms_per_token: float = 0.08
    prefill_overhead_ms: float = 10.0
    decode_step_ms: float = 8.0
    decode_ms_per_request: float = 0.0  # each new token's own arithmetic
    decode_ms_per_context_token: float = 0.0002


@dataclass(frozen=True, slots=True)
class StepWork:
    prefill_tokens: int = 0  # tokens computed for requests still reading their prompt
    decode_requests: int = 0  # requests producing their next token
    decode_context_tokens: int = 0  # total context of those requests


def step_seconds(model: TimingModel, work: StepWork) -> float:
    """Modelled duration of one step, in seconds (before any time scaling)."""
    ms = 0.0
    if work.prefill_tokens:
        ms += model.prefill_overhead_ms + model.prefill_ms_per_token * work.prefill_tokens
    if work.decode_requests:
        ms += (
            model.decode_step_ms
            + model.decode_ms_per_request * work.decode_requests
            + model.decode_ms_per_context_token * work.decode_context_tokens
        )
    return ms / 1000.0
