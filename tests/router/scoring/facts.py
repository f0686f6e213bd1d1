"""Candidates' facts written worker by worker, as the scoring tests read best."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from kvplane.core.types import Tier
from router.scoring.score import TIERS, CandidateFacts, Column

_NO_LABELS: Mapping[str, str] = MappingProxyType({})


class WorkerFacts(NamedTuple):
    """One row of CandidateFacts."""

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
    load_reported: bool = True  # False: only this router's requests are known
    max_model_len: float = np.inf  # the longest prompt plus output its engine takes


def facts_of(workers: Sequence[WorkerFacts]) -> CandidateFacts:
    """Rows gathered worker by worker, as columns."""
    matched = np.zeros((len(workers), len(TIERS)))
    for row, worker in enumerate(workers):
        for tier, tokens in worker.matched_tokens.items():
            matched[row, tier - Tier.DEVICE] = tokens

    def column(values: Sequence[float]) -> Column:
        return np.array(values, dtype=np.float64).reshape(len(workers))

    pools = np.empty(len(workers), dtype=object)
    pools[:] = [worker.pool for worker in workers]
    return CandidateFacts(
        worker_ids=[worker.worker_id for worker in workers],
        matched_tokens=matched,
        waiting_requests=column([w.waiting_requests for w in workers]),
        running_requests=column([w.running_requests for w in workers]),
        load_reported=np.array([w.load_reported for w in workers], dtype=np.bool_).reshape(
            len(workers)
        ),
        queued_prefill_tokens=column([w.queued_prefill_tokens for w in workers]),
        kv_usage=column([w.kv_usage for w in workers]),
        evicted_share=column([w.evicted_share for w in workers]),
        other_tenants_running=column([w.other_tenants_running for w in workers]),
        suspect=np.array([w.suspect for w in workers], dtype=np.bool_).reshape(len(workers)),
        labels=[worker.labels for worker in workers],
        pools=pools,
        max_model_len=column([w.max_model_len for w in workers]),
    )
