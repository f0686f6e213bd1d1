"""What the router learns from an engine's answer, once a request is settled: the cached
tokens it predicted against those the engine reported (the prediction's accuracy), the
prompt tokens it counted against the engine's (token agreement), the cache funnel, the
hot prefixes and the prefill saved.

A front door that sees no answer (the endpoint picker, which lets Envoy move the bytes)
settles with `usage=None`: the request is counted and its funnel step recorded, and the
comparisons wait for answers that carry usage.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvplane.core.types import Incarnation
from router.lifecycle.bodies import Usage
from router.lifecycle.legs import Leg
from router.metrics import RouterMetrics
from router.routing.accuracy import PredictionAccuracy, Verdict
from router.routing.decide import Decision, servable_blocks
from router.routing.evictions import RecentRemovals
from router.routing.funnel import CacheFunnel, funnel_step
from router.routing.hot_prefixes import HotPrefixes
from router.routing.pool import WorkerPool
from router.routing.token_agreement import TokenCountAgreement

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SentTo:
    """What the router said about a request where it sent it, for the comparisons once
    the answer is in."""

    worker_id: str
    incarnation: int
    model: str  # the worker's, as its agent registered it
    tenant: str
    decision: Decision
    predicted_tokens: int  # what x-kvplane-cached-tokens said
    indexed_tokens: int  # the part of it the index vouched for: what is judged
    dispatched_at: float  # on the router's clock, as evictions are recorded
    leg: Leg = Leg.WHOLE


class AnswerAccounting:
    def __init__(
        self,
        *,
        pool: WorkerPool,
        accuracy: PredictionAccuracy,
        agreement: TokenCountAgreement,
        funnel: CacheFunnel,
        removals: RecentRemovals,
        hot_prefixes: HotPrefixes,
        metrics: RouterMetrics,
    ) -> None:
        self.pool = pool
        self.accuracy = accuracy
        self.agreement = agreement
        self.funnel = funnel
        self.removals = removals
        self.hot_prefixes = hot_prefixes
        self.metrics = metrics
        # Worker incarnations seen sending prompt_tokens_details: from them, usage
        # without it means no cached tokens (vLLM leaves it out at zero).
        self._reporting_workers: set[Incarnation] = set()
        # Per model, the worker incarnations whose engines count prompts otherwise than
        # this router: its token counts cannot be held against their max_model_len.
        self._miscounting: dict[str, set[Incarnation]] = {}

    def answered(self, sent: SentTo, prompt_tokens: int, usage: Usage | None) -> None:
        """A successful answer (status under 400) from `sent.worker_id`; `prompt_tokens`
        is the router's count of the whole prompt (0: it could not tokenise it)."""
        if usage is not None:
            self._compare_token_counts(sent, prompt_tokens, usage)
        if sent.leg is Leg.DECODE:
            # Its engine reports the tokens it pulled (or the prefill's hits, vLLM 0.34)
            # as cached: nothing the index predicted there to judge, and the request went
            # through the funnel on its prefill leg.
            return
        reported = self._reported_cached_tokens((sent.worker_id, sent.incarnation), usage)
        if prompt_tokens:
            self._through_funnel(sent, prompt_tokens, reported)
        self._judge(sent, reported, engine_failed=False)

    def failed(self, sent: SentTo, usage: Usage | None) -> None:
        """An answer with an error status: only a usage it carries is judged."""
        self._judge(
            sent,
            self._reported_cached_tokens((sent.worker_id, sent.incarnation), usage),
            engine_failed=True,
        )

    def counts_otherwise(self, model: str) -> bool:
        """Whether an engine of `model` counts prompts otherwise than this router now.
        Its agreement window says so: the reaper drops the windows of workers that left
        or restarted, and with them their say here."""
        incarnations = self._miscounting.get(model)
        if not incarnations:
            return False
        incarnations -= {i for i in incarnations if not self.agreement.of(i).disagrees}
        return bool(incarnations)

    def _judge(self, sent: SentTo, reported: int | None, *, engine_failed: bool) -> None:
        if reported is None:
            if not engine_failed:
                self.metrics.prefill_tokens_saved.inc(sent.predicted_tokens)
            return
        worker = sent.worker_id
        self.metrics.prefill_tokens_saved.inc(reported)
        self.metrics.child(self.metrics.predicted_cached_tokens, worker=worker).inc(
            sent.predicted_tokens
        )
        self_predicted = sent.predicted_tokens - sent.indexed_tokens
        self.metrics.child(self.metrics.self_predicted_cached_tokens, worker=worker).inc(
            self_predicted
        )
        self.metrics.child(self.metrics.reported_cached_tokens, worker=worker).inc(reported)
        verdict = self.accuracy.observe(
            worker,
            sent.incarnation,
            sent.indexed_tokens,
            reported,
            self_predicted_tokens=self_predicted,
        )
        self.metrics.child(
            self.metrics.prediction_verdicts, worker=worker, verdict=verdict.value
        ).inc()
        if verdict is Verdict.STALE:
            log.info(
                "stale locations on %s: predicted %d cached tokens, the engine found %d",
                worker,
                sent.predicted_tokens,
                reported,
            )

    def _through_funnel(self, sent: SentTo, prompt_tokens: int, reported: int | None) -> None:
        """Add the request to the funnel's totals (the metrics read them at scrape time)
        and its longest match to the hot prefixes.

        Lost to eviction: the servable blocks right after the attainable prefix that
        the fleet removed lately, before the request went out (not the request's own,
        should its engine evict them meanwhile), up to the first it did not. Only the
        keys the decision holds are read: of a prompt routed on its start, the start's."""
        decision, worker = sent.decision, sent.worker_id
        longest = decision.longest_match()
        if longest is not None:
            self.hot_prefixes.matched(sent.tenant, longest.key, longest.tokens)
        attainable = 0 if longest is None else longest.tokens
        block_size = decision.block_size
        evicted_blocks = self.removals.removed_run(
            decision.keys,
            attainable // block_size,
            min(len(decision.keys), servable_blocks(prompt_tokens, block_size)),
            before=sent.dispatched_at,
        )
        evicted_at = self.pool.evictions.recorded(worker)[1]
        step = funnel_step(
            prompt_tokens=prompt_tokens,
            attainable_tokens=attainable,
            predicted_tokens=sent.predicted_tokens,
            predicted_off_device_tokens=decision.off_device_tokens(worker),
            holder_eligible=longest is None or longest.holder_eligible,
            achieved_tokens=reported,
            evicted_meanwhile=evicted_at > sent.dispatched_at,
            evicted_from_fleet_tokens=evicted_blocks * block_size,
        )
        self.funnel.add(sent.model, sent.tenant, worker, step)

    def _compare_token_counts(self, sent: SentTo, prompt_tokens: int, usage: Usage) -> None:
        """The router's prompt token count against the engine's (see
        router/routing/token_agreement.py)."""
        if not prompt_tokens or usage.prompt_tokens is None:
            return
        worker = sent.worker_id
        incarnation = (worker, sent.incarnation)
        matched = self.agreement.observe(incarnation, prompt_tokens, usage.prompt_tokens)
        miscounting = self._miscounting.setdefault(sent.model, set())
        if self.agreement.of(incarnation).disagrees:
            miscounting.add(incarnation)
        else:
            miscounting.discard(incarnation)
        self.metrics.child(
            self.metrics.prompt_token_checks,
            worker=worker,
            model=sent.model,
            result="match" if matched else "mismatch",
        ).inc()
        if not matched and self.agreement.warning_due(incarnation, time.monotonic()):
            agreement = self.agreement.of(incarnation)
            log.warning(
                "worker %s (model %s): the engine counted %d prompt tokens where the router "
                "counted %d (%d of the last %d requests differ): the router does not tokenise "
                "as this engine does, so its block keys never match the engine's and routing "
                "there runs on the router's own predictions only; give the router the "
                "engine's tokenizer and chat template (docs/troubleshooting.md)",
                worker,
                sent.model,
                usage.prompt_tokens,
                prompt_tokens,
                agreement.mismatches,
                agreement.samples,
            )

    def _reported_cached_tokens(self, incarnation: Incarnation, usage: Usage | None) -> int | None:
        if usage is None:
            return None
        if usage.cached_tokens is not None:
            self._reporting_workers.add(incarnation)
            return usage.cached_tokens
        return 0 if incarnation in self._reporting_workers else None
