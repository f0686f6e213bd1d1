"""The router's Prometheus metrics.

Each router instance owns a CollectorRegistry rather than using the process-wide
default one, so several routers can run in one process (the tests do) without their
series colliding. Gauges that mirror the index are refreshed on scrape, so they cost
nothing between scrapes and are never older than the scrape itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvplane.core.types import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, LoadReport
from router.index.base import IndexStats, WorkerState


class WorkerLoadSample(NamedTuple):
    """One candidate worker's load as this router sees it, at scrape time."""

    worker_id: str
    in_flight: int  # this router's requests on it
    prefill_tokens: int  # their uncached prompt tokens before the first byte
    load: LoadReport | None  # the worker's last report to this router


class WorkerWiringSample(NamedTuple):
    """One worker's wiring checks, (check, status) pairs, at scrape time."""

    worker_id: str
    checks: Sequence[tuple[str, str]]
    blind: bool


# Latency of index.apply: an in-memory apply takes microseconds, a Redis one a round
# trip or a few.
_APPLY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# A routing decision (and its lookup) takes tens of microseconds in memory, a Redis
# round trip or two.
_DECISION_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A wait in flow control's queue: up to flow_control.max_wait_s, which may be minutes.
_WAIT_BUCKETS = (*_TTFB_BUCKETS, 120, 300, 600)


def _event_kind(event: KvEvent) -> str:
    if isinstance(event, BlocksStored):
        return "stored"
    if isinstance(event, BlocksRemoved):
        return "removed"
    return "cleared"


NO_WORKER = "none"  # the worker label of a request no worker answered


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events_applied = Counter(
            "kvplane_events_applied", "KV events applied to the index", ["kind"], registry=r
        )
        self.blocks_applied = Counter(
            "kvplane_blocks_applied", "Blocks stored or removed in the index", ["kind"], registry=r
        )
        self.batches_applied = Counter(
            "kvplane_batches_applied", "KvEvents batches applied to the index", registry=r
        )
        self.duplicate_batches = Counter(
            "kvplane_duplicate_batches",
            "KvEvents batches with a sequence applied already (ignored, acked again)",
            registry=r,
        )
        self.rejects = Counter(
            "kvplane_rejects", "Messages refused with a Reject", ["reason"], registry=r
        )
        self.resyncs = Counter("kvplane_resyncs", "Resyncs sent to agents", ["reason"], registry=r)
        self.streams = Gauge(
            "kvplane_control_streams", "Open agent streams on this router", registry=r
        )
        self.workers = Gauge(
            "kvplane_workers", "Workers this router has seen, by state", ["state"], registry=r
        )
        self.index_entries = Gauge(
            "kvplane_index_entries", "(key, worker, tier) locations in the index", registry=r
        )
        self.index_keys = Gauge(
            "kvplane_index_keys", "Distinct block keys in the index", registry=r
        )
        self.index_workers = Gauge(
            "kvplane_index_workers", "Workers registered in the index", registry=r
        )
        self.index_bytes = Gauge(
            "kvplane_index_bytes", "The index backend's estimate of its memory", registry=r
        )
        self.index_max_entries = Gauge(
            "kvplane_index_max_entries",
            "index.max_entries: past it the index evicts (dead workers' entries first)",
            registry=r,
        )
        self.index_server_memory_used = Gauge(
            "kvplane_index_server_memory_used_ratio",
            "The fullest Redis server's used_memory over its maxmemory (NaN: no limit set, "
            "or the index is in the router's memory)",
            registry=r,
        )
        self.index_server_memory_used.set(math.nan)
        self.index_up = Gauge(
            "kvplane_index_up", "1 when the last index stats read succeeded", registry=r
        )
        self.apply_seconds = Histogram(
            "kvplane_apply_seconds", "Time to apply one batch", buckets=_APPLY_BUCKETS, registry=r
        )
        self.lookup_seconds = Histogram(
            "kvplane_lookup_seconds",
            "Time to look up one request's block keys in the index",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.index_errors = Counter(
            "kvplane_index_errors",
            "Index calls that raised, by operation and error (CancelledError: the caller "
            "stopped waiting)",
            ["operation", "error"],
            registry=r,
        )
        self.event_lag_seconds = Histogram(
            "kvplane_event_lag_seconds",
            "Time from the engine publishing a KV event batch to the index applying it "
            "(agent's clock against this router's: includes clock skew)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.load_lag_seconds = Histogram(
            "kvplane_load_lag_seconds",
            "Receipt time minus the agent's Load timestamp (includes clock skew)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "kvplane_requests",
            "Proxied requests by outcome and the worker that answered (none: no worker did)",
            ["outcome", "worker"],
            registry=r,
        )
        self.decisions = Counter(
            "kvplane_routing_decisions",
            "Routing decisions by the score term that set the winner apart",
            ["factor"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvplane_decision_seconds",
            "Time to decide: key, look up, score (tokenisation not included)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "kvplane_tokenize_seconds",
            "Time to tokenise a request's prompt",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.first_byte_seconds = Histogram(
            "kvplane_upstream_first_byte_seconds",
            "Time from sending to an engine to its first byte (a stream's time to first token)",
            buckets=_TTFB_BUCKETS,
            registry=r,
        )
        # Flow control (router/flow_control): requests waiting for saturated engines.
        self.flow_queued = Gauge(
            "kvplane_flow_queued_requests",
            "Requests waiting in the router for their model's engines to make room, by band",
            ["model", "band"],
            registry=r,
        )
        self.flow_wait_seconds = Histogram(
            "kvplane_flow_wait_seconds",
            "Time requests of a saturated model waited in the router (shed ones, and those "
            "whose client left, included)",
            ["band", "tenant"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.flow_shed = Counter(
            "kvplane_flow_shed",
            "Requests shed with a 429 by flow control, by tenant and reason",
            ["tenant", "reason"],
            registry=r,
        )
        self.flow_service_tokens = Counter(
            "kvplane_flow_service_tokens",
            "Service each tenant had, in flow control's cost units (prompt tokens computed "
            "x input_token_cost, generated x output_token_cost, their context x "
            "context_token_cost): its share is its rate over all tenants'",
            ["tenant", "kind"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "kvplane_predicted_cached_tokens",
            "Cached prompt tokens the router predicted, for requests whose engine reported",
            ["worker"],
            registry=r,
        )
        self.self_predicted_cached_tokens = Counter(
            "kvplane_self_predicted_cached_tokens",
            "The part of the predicted cached tokens that only this router's own predicted "
            "entries claimed (no engine event vouched for it), for requests whose engine "
            "reported",
            ["worker"],
            registry=r,
        )
        self.prompt_token_checks = Counter(
            "kvplane_prompt_token_checks",
            "The router's prompt token count against the engine's usage.prompt_tokens, by "
            "worker, its model and result (match, mismatch: the router does not tokenise as "
            "the engine does)",
            ["worker", "model", "result"],
            registry=r,
        )
        self.reported_cached_tokens = Counter(
            "kvplane_reported_cached_tokens",
            "Cached prompt tokens engines reported (usage.prompt_tokens_details)",
            ["worker"],
            registry=r,
        )
        # The cache-loss funnel: read from its totals at scrape time.
        self.funnel = FunnelCollector()
        r.register(self.funnel)
        self.prefill_tokens_saved = Counter(
            "kvplane_prefill_tokens_saved",
            "Prompt tokens served from cache (reported by the engine, else predicted)",
            registry=r,
        )
        self.prediction_verdicts = Counter(
            "kvplane_prediction_verdicts",
            "Predicted against reported cached tokens: confirmed, stale (a location the "
            "engine no longer had: a stale-location miss), better",
            ["worker", "verdict"],
            registry=r,
        )
        self.prefill_legs = Counter(
            "kvplane_prefill_legs",
            "Prefill legs of disaggregated requests, by outcome (the request itself is "
            "counted once, in kvplane_requests, by its decode leg or its fallback)",
            ["outcome"],
            registry=r,
        )
        self.legs_decided = Counter(
            "kvplane_legs_decided",
            "Requests of models with prefill/decode workers: split or whole, and why",
            ["split", "reason"],
            registry=r,
        )
        self.disaggregation_fallbacks = Counter(
            "kvplane_disaggregation_fallbacks",
            "Split requests that did not run as planned, by what happened instead: "
            "prefill_failed (every prefill worker failed: whole on decode), prefill_refused "
            "(a 4xx: whole on decode, whose answer the client gets), no_kv_params "
            "(the prefill handed nothing on: decode computed the prompt), kv_load_failed "
            "(the decode worker could not pull: whole on decode), no_prefill_worker "
            "(whole on decode: none was live)",
            ["reason"],
            registry=r,
        )
        self.failovers = Counter(
            "kvplane_failovers",
            "Attempts abandoned before the first byte for the next worker",
            ["worker", "reason"],
            registry=r,
        )
        self.index_degraded = Gauge(
            "kvplane_index_degraded",
            "1 while the index does not answer lookups and routing uses load only",
            registry=r,
        )
        self.worker_load = Gauge(
            "kvplane_worker_load",
            "Each worker's load as this router sees it (reports plus its own traffic)",
            ["worker", "kind"],
            registry=r,
        )
        self.skipped_events = Gauge(
            "kvplane_worker_skipped_events",
            "Engine events each worker's agent skipped since it started, as it last reported: "
            "events it could not use (the rest of their batches applied), by the engine's "
            "event type and the reason (malformed, unknown_type, unknown_medium, remote); at "
            "most 16 kinds a worker",
            ["worker", "event_type", "reason"],
            registry=r,
        )
        self.wiring_checks = Gauge(
            "kvplane_worker_wiring_check",
            "1 for each worker's wiring check in its current status (pass, warn, fail, "
            "unknown); checks: events, replay, block_size, tokenizer, index_vouches",
            ["worker", "check", "status"],
            registry=r,
        )
        self.blind_workers = Gauge(
            "kvplane_worker_blind",
            "1 while a blinding wiring check fails for the worker: the router cannot see "
            "its cache and routes there on its own predictions only",
            ["worker"],
            registry=r,
        )
        self.predictions_only = Gauge(
            "kvplane_model_routing_predictions_only",
            "1 while every worker of the model is blind: its routing runs on the router's "
            "own predicted entries alone (approximate, like a text tree)",
            ["model"],
            registry=r,
        )
        self.event_loop_tasks = Gauge(
            "kvplane_event_loop_tasks",
            "asyncio tasks alive in the router's event loop (a leak shows as growth)",
            registry=r,
        )
        # process_resident_memory_bytes, process_open_fds, ... (Linux only; a no-op elsewhere)
        ProcessCollector(registry=r)
        self.suspect_workers = Gauge(
            "kvplane_suspect_workers",
            "Workers whose index entries keep failing predictions (counted as uncached)",
            registry=r,
        )
        self.worker_suspicions = Counter(
            "kvplane_worker_suspicions",
            "Times a worker's index entries turned suspect (its predictions kept failing)",
            ["worker"],
            registry=r,
        )
        self.credit_withdrawn = Gauge(
            "kvplane_worker_credit_withdrawn",
            "1 while a worker that turned suspect again and again has no cache credit",
            ["worker"],
            registry=r,
        )
        self.token_cache_lookups = Gauge(
            "kvplane_token_cache_lookups",
            "Tokenisations looked up in the cache of identical prompts since start, by result",
            ["result"],
            registry=r,
        )
        self.token_cache_tokens = Gauge(
            "kvplane_token_cache_tokens",
            "Token ids held by the caches of prompts and of prompt pieces",
            registry=r,
        )
        self.prompt_piece_tokens = Gauge(
            "kvplane_prompt_piece_tokens",
            "Token ids of prompt pieces since start, by source: reused from the piece cache "
            "or tokenised",
            ["source"],
            registry=r,
        )
        self.prompt_rests = Counter(
            "kvplane_prompt_rests",
            "Prompts whose start the piece cache held and whose new end was short, by when "
            "that end was tokenised: after the answer (routed on the start) or before "
            "routing (it could have changed the worker)",
            ["tokenised"],
            registry=r,
        )
        for when in ("after_answer", "before_routing"):
            self.prompt_rests.labels(tokenised=when)
        self.piecewise_checks = Gauge(
            "kvplane_piecewise_tokenisation_checks",
            "Piecewise tokenisations compared with whole tokenisation since start, by result "
            "(any 'different' turns pieces off for that tokenizer)",
            ["result"],
            registry=r,
        )
        for state in WorkerState:
            self.workers.labels(state=state.value)
        # The counters labelled by worker (the gauges are set afresh at each scrape).
        self._by_worker: list[Counter] = [
            self.requests,
            self.predicted_cached_tokens,
            self.self_predicted_cached_tokens,
            self.prompt_token_checks,
            self.reported_cached_tokens,
            self.prediction_verdicts,
            self.failovers,
            self.worker_suspicions,
        ]
        self._children: dict[tuple[Counter, tuple[tuple[str, str], ...]], Counter] = {}

    def child(self, metric: Counter, **labels: str) -> Counter:
        """`metric.labels(**labels)`, kept: prometheus-client checks the names and takes a
        lock on every labels() call, a few µs that each request paid several times over.
        For counters that are only ever incremented or pruned by retain_workers (which
        forgets the kept children with them), never cleared."""
        key = (metric, tuple(labels.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**labels)
        return child

    def batch_applied(self, events: Sequence[KvEvent], seconds: float) -> None:
        self.batches_applied.inc()
        self.apply_seconds.observe(seconds)
        # Summed first: a batch carries up to hundreds of events, and each child counter
        # costs a label lookup and a lock.
        events_by_kind: dict[str, int] = {}
        blocks_by_kind: dict[str, int] = {}
        for event in events:
            kind = _event_kind(event)
            events_by_kind[kind] = events_by_kind.get(kind, 0) + 1
            if not isinstance(event, AllBlocksCleared):
                blocks_by_kind[kind] = blocks_by_kind.get(kind, 0) + len(event.keys)
        for kind, count in events_by_kind.items():
            self.events_applied.labels(kind=kind).inc(count)
        for kind, count in blocks_by_kind.items():
            self.blocks_applied.labels(kind=kind).inc(count)

    def set_worker_counts(self, counts: dict[WorkerState, int]) -> None:
        for state, count in counts.items():
            self.workers.labels(state=state.value).set(count)

    def set_index_stats(self, stats: IndexStats | None) -> None:
        """None: the index did not answer; the last figures stay (Redis' memory share
        but for), index_up drops to 0."""
        self.index_up.set(0 if stats is None else 1)
        if stats is None:
            self.index_server_memory_used.set(math.nan)  # unknown, not the last figure
        else:
            self.index_entries.set(stats.entries)
            self.index_keys.set(stats.keys)
            self.index_workers.set(stats.workers)
            self.index_bytes.set(stats.bytes)
            used = stats.server_memory_used
            self.index_server_memory_used.set(math.nan if used is None else used)

    def retain_workers(self, worker_ids: Iterable[str]) -> None:
        """Drop the series of workers that left the fleet (the reaper purged them), so
        that the worker label's values stay the fleet's, however many pods come and go."""
        keep = {*worker_ids, NO_WORKER}
        for metric in self._by_worker:
            labelled = {
                sample.labels["worker"] for family in metric.collect() for sample in family.samples
            }
            for worker in labelled - keep:
                metric.remove_by_labels({"worker": worker})
                self._children.clear()  # a removed child counts no more: look it up again

    def set_routing_view(
        self,
        *,
        degraded: bool,
        suspect_workers: int,
        loads: Iterable[WorkerLoadSample],
        credit_withdrawn: Iterable[str] = (),
    ) -> None:
        """Refresh the gauges of the router's picture of its workers (on scrape)."""
        self.index_degraded.set(1 if degraded else 0)
        self.suspect_workers.set(suspect_workers)
        self.credit_withdrawn.clear()
        for worker in credit_withdrawn:
            self.credit_withdrawn.labels(worker=worker).set(1)
        self.worker_load.clear()
        self.skipped_events.clear()
        for worker, in_flight, prefill_tokens, load in loads:
            self.worker_load.labels(worker=worker, kind="router_in_flight").set(in_flight)
            self.worker_load.labels(worker=worker, kind="router_prefill_tokens").set(prefill_tokens)
            if load is not None:
                self.worker_load.labels(worker=worker, kind="running").set(load.running)
                self.worker_load.labels(worker=worker, kind="waiting").set(load.waiting)
                self.worker_load.labels(worker=worker, kind="kv_usage").set(load.kv_usage)
                if load.kv_load_failures or load.kv_leases_expired:
                    kinds = (("kv_load_failures", load.kv_load_failures),
                             ("kv_leases_expired", load.kv_leases_expired))  # fmt: skip
                    for kind, count in kinds:
                        self.worker_load.labels(worker=worker, kind=kind).set(count)
            for skipped in (
                () if load is None or load.wiring is None else load.wiring.skipped_events
            ):
                self.skipped_events.labels(
                    worker=worker, event_type=skipped.event_type, reason=skipped.reason.value
                ).set(skipped.count)

    def set_wiring(
        self, workers: Iterable[WorkerWiringSample], predictions_only: Mapping[str, bool]
    ) -> None:
        """Each worker's wiring checks, and per model whether it is routed on predictions
        only (on scrape: workers and models come and go)."""
        self.wiring_checks.clear()
        self.blind_workers.clear()
        for worker, checks, blind in workers:
            for check, status in checks:
                self.wiring_checks.labels(worker=worker, check=check, status=status).set(1)
            self.blind_workers.labels(worker=worker).set(1 if blind else 0)
        self.predictions_only.clear()
        for model, only in predictions_only.items():
            self.predictions_only.labels(model=model).set(1 if only else 0)

    def set_tokenisation(
        self,
        *,
        prompt_hits: int,
        prompt_misses: int,
        piece_tokens_reused: int,
        piece_tokens_tokenised: int,
        cached_tokens: int,
        piecewise_checks: int,
        piecewise_differences: int,
    ) -> None:
        self.token_cache_lookups.labels(result="hit").set(prompt_hits)
        self.token_cache_lookups.labels(result="miss").set(prompt_misses)
        self.token_cache_tokens.set(cached_tokens)
        self.prompt_piece_tokens.labels(source="reused").set(piece_tokens_reused)
        self.prompt_piece_tokens.labels(source="tokenised").set(piece_tokens_tokenised)
        self.piecewise_checks.labels(result="equal").set(piecewise_checks - piecewise_differences)
        self.piecewise_checks.labels(result="different").set(piecewise_differences)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FunnelSample(NamedTuple):
    """One model and tenant's funnel totals, by the names the metrics label them with."""

    model: str
    tenant: str
    stages: Mapping[str, int]
    losses: Mapping[str, int]
    reported_prompt_tokens: int
    copied_tokens: int


class FunnelCollector(Collector):
    """The cache-loss funnel's totals (router/routing/funnel.py) as counters, per model
    and tenant, both bounded (registered models, configured tenants): read from
    `source` at scrape time, so that a request adds to the totals once."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[FunnelSample]] = list

    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "kvplane_funnel_tokens",
            "Prompt tokens of answered requests by funnel stage: prompt, attainable (held "
            "anywhere), predicted (held where it went), achieved (the engine reported cached)",
            labels=["model", "tenant", "stage"],
        )
        lost = CounterMetricFamily(
            "kvplane_funnel_lost_tokens",
            "Tokens a funnel stage lost against the one before it, by reason "
            "(evicted_from_fleet: of the prompt's, ones the fleet held and evicted lately)",
            labels=["model", "tenant", "reason"],
        )
        copied = CounterMetricFamily(
            "kvplane_funnel_copied_tokens",
            "Duplication: prompt tokens prefilled on a worker while another held them "
            "(routed_for_load plus holder_unavailable), which the fleet then holds twice",
            labels=["model", "tenant"],
        )
        reported = CounterMetricFamily(
            "kvplane_funnel_reported_prompt_tokens",
            "Prompt tokens of the answered requests whose engine reported its cached tokens "
            "(what the achieved stage is a share of)",
            labels=["model", "tenant"],
        )
        for sample in self.source():
            labels = [sample.model, sample.tenant]
            for stage, count in sample.stages.items():
                tokens.add_metric([*labels, stage], count)
            for reason, count in sample.losses.items():
                lost.add_metric([*labels, reason], count)
            reported.add_metric(labels, sample.reported_prompt_tokens)
            copied.add_metric(labels, sample.copied_tokens)
        yield from (tokens, lost, reported, copied)
