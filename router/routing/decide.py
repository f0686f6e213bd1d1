"""One routing decision: key the prompt, look it up, rank every candidate.

The ranking itself is the configured policy's (router/scoring/policy.py); this module
gathers its inputs (index lookup, predicted entries, load, tenant traffic) and records
what was decided. When the index cannot answer within its timeout the decision goes on
with load and this router's own predicted entries only, and says so.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvplane.core.clock import Clock
from kvplane.core.keys import BlockKey, KeyNamespace, block_keys
from kvplane.core.types import Tier
from router.index.base import LocationIndex, LocationIndexError, PrefixMatch, index_deadline
from router.routing.accuracy import PredictionAccuracy
from router.routing.evictions import RecentEvictions
from router.routing.fleet import Candidate, Fleet
from router.routing.predicted import PredictedPrefixes
from router.scoring.policy import RoutingPolicy
from router.scoring.score import RequestFacts, ScoreBreakdown, WorkerFacts, queue_estimate
from router.tenants import POOL_LABEL, Tenant
from router.tracing import Tracer

log = logging.getLogger(__name__)

INDEX_PROBE_INTERVAL_S = 0.5
"""While lookups fail, how often one request tries the index again."""


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: list[ScoreBreakdown]  # eligible workers, best first
    candidates: Mapping[str, Candidate]
    matched_blocks: Mapping[str, Mapping[Tier, int]]  # per worker, what was believed
    indexed_blocks: Mapping[str, int]  # per worker, the part the index vouched for
    keys: list[BlockKey]
    prompt_tokens: int
    block_size: int
    index_answered: bool  # False: load-only (plus this router's predictions)
    factor: str
    seconds: float

    def predicted_tokens(self, worker_id: str) -> int:
        """The cached prefix the router expects the engine to report for this request."""
        return sum(self.matched_blocks.get(worker_id, {}).values()) * self.block_size

    def indexed_tokens(self, worker_id: str) -> int:
        """The part of the prediction the worker's own events vouched for (a predicted
        entry may still be prefilling on the engine, which cannot share it yet)."""
        return self.indexed_blocks.get(worker_id, 0) * self.block_size


def servable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks an engine can serve from cache: it always computes the prompt's last token,
    so a fully cached prompt hits one token short of its length."""
    return max(0, prompt_tokens - 1) // block_size


class RoutingPlanner:
    def __init__(
        self,
        *,
        index: LocationIndex,
        fleet: Fleet,
        predicted: PredictedPrefixes,
        accuracy: PredictionAccuracy,
        evictions: RecentEvictions,
        policy: RoutingPolicy,
        block_size: int,
        index_timeout_s: float,
        tracer: Tracer,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.index = index
        self.fleet = fleet
        self.predicted = predicted
        self.accuracy = accuracy
        self.evictions = evictions
        self.policy = policy
        self.block_size = block_size
        self.index_timeout_s = index_timeout_s
        self.tracer = tracer
        self.rng = rng or random.Random()
        self._clock = clock
        self.index_answering = True
        self._next_lookup_probe = 0.0  # while the index is down: when to try it again

    def keys(self, model: str, cache_scope: str, tokens: Sequence[int]) -> list[BlockKey]:
        namespace = KeyNamespace(model=model, block_size=self.block_size, cache_scope=cache_scope)
        return block_keys(tokens, namespace)

    async def decide(
        self, *, model: str, tenant: Tenant, cache_scope: str, tokens: Sequence[int]
    ) -> Decision:
        """Rank the candidates serving `model` for a prompt of `tokens`, keyed in
        `cache_scope` (the tenant's salt, or a salt the client sent in the shared
        scope; empty for none)."""
        started = time.perf_counter()
        with self.tracer.start_as_current_span("kvplane.key") as span:
            keys = self.keys(model, cache_scope, tokens)
            span.set_attribute("kvplane.blocks", len(keys))
        # No worker registered under the model's name: it may be a LoRA adapter, which
        # engines serve under the base model's registration. Any worker may take it on
        # load, and the engine judges whether it serves the model.
        serving = self.fleet.candidates(model) or self.fleet.candidates()
        candidates = {c.worker_id: c for c in serving}
        index_matches, answered = await self._lookup(keys, bool(candidates))
        with self.tracer.start_as_current_span("kvplane.score") as span:
            span.set_attribute("kvplane.index_answered", answered)
            now = self._clock()
            self.predicted.prune(now)
            predicted = self.predicted.match(keys, now) if candidates else {}
            limit = servable_blocks(len(tokens), self.block_size)
            matched = {
                worker_id: _combined(index_matches.get(worker_id), predicted.get(worker_id), limit)
                for worker_id in candidates
            }
            indexed = {
                worker_id: min(match.blocks, limit)
                for worker_id, match in index_matches.items()
                if worker_id in candidates
            }
            facts = [
                self._facts(candidate, matched[worker_id], tenant, now)
                for worker_id, candidate in candidates.items()
            ]
            request = RequestFacts(
                prompt_tokens=len(tokens),
                isolation=tenant.isolation,
                required_labels=tenant.required_labels,
                pool=tenant.pool,
            )
            ranked, factor = self.policy.rank(request, facts, self.rng)
            span.set_attribute("kvplane.candidates", len(candidates))
            span.set_attribute("kvplane.factor", factor)
        return Decision(
            ranked=ranked,
            candidates=candidates,
            matched_blocks=matched,
            indexed_blocks=indexed,
            keys=keys,
            prompt_tokens=len(tokens),
            block_size=self.block_size,
            index_answered=answered,
            factor=factor,
            seconds=time.perf_counter() - started,
        )

    def routed(self, decision: Decision, worker_id: str) -> None:
        """The request went to `worker_id`: its prefix is predicted there from now on."""
        servable = decision.keys[: servable_blocks(decision.prompt_tokens, self.block_size)]
        self.predicted.record(worker_id, servable, self._clock())
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", _routed_line(decision, worker_id, servable[-1] if servable else None))

    async def _lookup(
        self, keys: list[BlockKey], wanted: bool
    ) -> tuple[dict[str, PrefixMatch], bool]:
        if not keys or not wanted:
            return {}, True
        if not self.index_answering and self._clock() < self._next_lookup_probe:
            # An index that stopped answering costs each request its timeout: only one
            # request per probe interval pays it, the others route on load at once.
            return {}, False
        try:
            async with index_deadline(self.index_timeout_s):
                matches = await self.index.lookup(keys)
        except LocationIndexError as error:  # the index is down or slow: route on load alone
            if self.index_answering:
                log.warning(
                    "the index did not answer a lookup (%s): routing on load only until it does",
                    type(error).__name__,
                )
            self.index_answering = False
            self._next_lookup_probe = self._clock() + INDEX_PROBE_INTERVAL_S
            return {}, False
        if not self.index_answering:
            log.warning("the index answers lookups again: routing on cached prefixes")
        self.index_answering = True
        return matches, True

    def _facts(
        self, candidate: Candidate, matched: Mapping[Tier, int], tenant: Tenant, now: float
    ) -> WorkerFacts:
        info, load, traffic = candidate.info, candidate.load, candidate.traffic
        # Without a report (the agent streams to another router replica) this router's
        # own traffic is all it knows.
        received_at = candidate.load_received_at
        reported = None if load is None or received_at is None else (load.waiting, load.running)
        waiting, running = queue_estimate(
            reported,
            0 if received_at is None else traffic.prefilling_sent_after(received_at),
            traffic.in_flight,
            traffic.prefilling,
        )
        return WorkerFacts(
            worker_id=info.worker_id,
            matched_tokens={tier: blocks * self.block_size for tier, blocks in matched.items()}
            if matched
            else _NOTHING,
            waiting_requests=waiting,
            running_requests=running,
            queued_prefill_tokens=traffic.prefill_tokens,
            kv_usage=load.kv_usage if load is not None else 0.0,
            evicted_share=self.evictions.share(info.worker_id, info.kv_capacity_blocks, now),
            other_tenants_running=traffic.in_flight - traffic.by_tenant.get(tenant.name, 0),
            labels=info.labels,
            pool=info.labels.get(POOL_LABEL),
            suspect=self.accuracy.is_suspect(info.worker_id, info.incarnation),
        )


_NOTHING: Mapping[Tier, int] = MappingProxyType({})
_LOGGED_CANDIDATES = 8  # a line per decision stays short in a fleet of thousands


def _routed_line(decision: Decision, worker_id: str, last_key: BlockKey | None) -> str:
    """One decision, for the debug log: numbers and hashes only, never the prompt. A
    block key names its whole prefix: where the longest match ends at an earlier
    request's `prefix` key, this request extends that one (a chat's next turn whose
    engine did not also cache the answer), and it can be told without any text."""
    candidates = "; ".join(
        f"{b.worker_id} cached={b.cached_tokens} saved={b.saved_tokens:.0f} "
        f"queue={b.queue_penalty:.0f} memory={b.memory_penalty:.0f} "
        f"tenant={b.tenant_penalty:.0f}"
        for b in decision.ranked[:_LOGGED_CANDIDATES]
    )
    longest = max((sum(m.values()) for m in decision.matched_blocks.values()), default=0)
    return (
        f"routed {decision.prompt_tokens} prompt tokens (prefix {_hex(last_key)}, longest "
        f"match ending at {_hex(decision.keys[longest - 1] if longest else None)}) to "
        f"{worker_id} by {decision.factor}; ranked: {candidates}"
    )


def _hex(key: BlockKey | None) -> str:
    return "none" if key is None else f"{key:016x}"


def _combined(
    index_match: PrefixMatch | None, predicted_blocks: int | None, limit: int
) -> Mapping[Tier, int]:
    """Blocks per tier the worker is believed to hold: the index's match, extended on
    the device tier by a longer prediction, cut to what the engine can serve."""
    if index_match is None and predicted_blocks is None:
        return _NOTHING  # most workers, for most requests: kept cheap
    if (
        index_match is not None
        and (predicted_blocks is None or predicted_blocks <= index_match.blocks)
        and index_match.blocks <= limit
    ):
        return index_match.by_tier
    by_tier = dict(index_match.by_tier) if index_match is not None else {}
    held = sum(by_tier.values())
    if predicted_blocks is not None and predicted_blocks > held:
        by_tier[Tier.DEVICE] = by_tier.get(Tier.DEVICE, 0) + predicted_blocks - held
        held = predicted_blocks
    excess = held - limit
    for tier in sorted(by_tier, reverse=True):  # the slowest tiers give way first
        if excess <= 0:
            break
        cut = min(excess, by_tier[tier])
        by_tier[tier] -= cut
        excess -= cut
    return {tier: blocks for tier, blocks in by_tier.items() if blocks > 0}
