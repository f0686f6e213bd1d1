"""One generation request's life in the router, whichever front door it came through.

    admit (tenant, limits) -> route (parse, tokenise, decide) -> dispatch to a worker
    (its ticket and predicted entry) -> settle with the engine's answer, or abandon
    -> close

The embedded proxy (router/proxy/service.py) and the gateway's endpoint picker
(router/picker/) are front doors over this: they move the bytes, or let Envoy move them,
and map a RequestRefused to their own form of error at their edge. What the router holds
for a request is taken and given back here, each in one place: the tenant's slot in
RequestLifecycle.close, a worker's ticket and predicted entry in Dispatch._end.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvplane.core.clock import Clock
from kvplane.core.config import ProxySettings
from router.auth import unauthorized
from router.errors import RequestRefused, unavailable
from router.flow_control import FlowGate, FlowPass, Placement, placement
from router.lifecycle.accounting import AnswerAccounting, SentTo
from router.lifecycle.bodies import (
    BadRequest,
    Endpoint,
    ParsedRequest,
    Usage,
    body_for_engine,
    key_scope,
    parse_body,
    with_engine_priority,
    without_client_priority,
)
from router.lifecycle.legs import Leg
from router.lifecycle.tokens import PromptLength, PromptStart, PromptTokens, PromptTooLong
from router.metrics import NO_WORKER, RouterMetrics
from router.routing.decide import Decision, RoutingPlanner
from router.routing.pool import Ticket, WorkerPool
from router.scoring.disaggregation import LegPlan, LegReason
from router.tenant_limits import TenantLimiter
from router.tenants import Tenant, TenantDirectory
from router.tracing import Tracer

log = logging.getLogger(__name__)

WaitWrapper = Callable[[Awaitable[Any]], Awaitable[Any]]
"""What a front door wraps a wait in (the proxy's ends it when the client leaves)."""

_NO_PREFILL_WARNING_S = 60.0  # a model without prefill workers is said again after this
SCHEDULING_LABEL = "kvplane.io/scheduling-policy"
"""A worker label: `priority` where its engine runs vLLM's `--scheduling-policy priority`
(the engine tells no one: its operator labels the agent)."""


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """A request decided: where it may go, best first, and the body to send there."""

    parsed: ParsedRequest
    decision: Decision
    body: bytes  # the client's, with the tenant's cache salt
    # The prompt's whole ids, where it was routed on its start: tokenised once the
    # answer is settled, for the count and the predicted entries (None: whole already).
    prompt_rest: Callable[[], Sequence[int]] | None
    # vLLM's `priority` for engines in priority mode (lower first): by its band, then
    # its tenant's backlog (router/flow_control/bands.py); 0 for none.
    engine_priority: int = 0

    def worker_ids(self, at_most: int) -> list[str]:
        """The ranked workers to try, best first."""
        ranked = self.decision.ranked
        return [ranked.worker_id(i) for i in range(min(len(ranked), at_most))]

    def engine_body(self, body: bytes, worker_ids: Sequence[str]) -> bytes:
        """`body` as the engines of `worker_ids` (every one may get it) take it: with
        the request's priority where each is labelled as running vLLM's priority
        scheduling; as it is otherwise (vLLM in its default mode would not order by it,
        and an engine that is not vLLM may refuse it)."""
        if not self.engine_priority or not worker_ids:
            return body
        info = self.decision.info
        if all(info(worker).labels.get(SCHEDULING_LABEL) == "priority" for worker in worker_ids):
            return with_engine_priority(body, self.engine_priority)
        return body


class RequestFlow:
    """The collaborators every request's life needs; one per router."""

    def __init__(
        self,
        *,
        settings: ProxySettings,
        tenants: TenantDirectory,
        pool: WorkerPool,
        planner: RoutingPlanner,
        limiter: TenantLimiter,
        accounting: AnswerAccounting,
        metrics: RouterMetrics,
        tracer: Tracer,
        gate: FlowGate | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.gate = gate  # None: flow control is off
        self.tenants = tenants
        self.pool = pool
        self.planner = planner
        self.limiter = limiter
        self.accounting = accounting
        self.metrics = metrics
        self.tracer = tracer
        self.clock = clock  # the router's, on which evictions are recorded
        self.prompt_tokens = PromptTokens(settings)
        self._no_prefill_warned: dict[str, float] = {}  # model -> when last said

    def admit(
        self,
        authorization: str | None,
        priority: str | None = None,
        deadline_ms: str | None = None,
    ) -> RequestLifecycle:
        """A request's life from here, once its tenant is known and within its limits
        (checked before the body is read: a refusal costs nothing); `close` it however
        it ends. `priority` and `deadline_ms`: its flow control headers, where present."""
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise self.refused(unauthorized())
        where = Placement(tenant.priority)
        if self.gate is not None and (priority is not None or deadline_ms is not None):
            try:
                where = placement(tenant, priority, deadline_ms)
            except RequestRefused as error:
                raise self.refused(error) from None
        limit = self.limiter.admit(tenant)
        if limit is not None:
            raise self.refused(limit.error())
        return RequestLifecycle(self, tenant, where)

    def refused(self, error: RequestRefused) -> RequestRefused:
        """`error`, counted: a front door passes every refusal through here."""
        self.count(error.outcome)
        return error

    def count(self, outcome: str, worker: str = NO_WORKER) -> None:
        self.metrics.child(self.metrics.requests, outcome=outcome, worker=worker).inc()

    def prompt_length(self, model: str) -> PromptLength:
        """How long `model`'s prompts may be. The limit: the longest any of its engines
        takes and the configured cap, the lower; the cap alone while the engines' length
        is unknown. The engines' lengths are left out while one of them counts prompts
        otherwise than this router (another tokenizer): the router's count would refuse
        prompts the engines take."""
        miscounted = self.accounting.counts_otherwise(model)
        engines = None if miscounted else self.pool.roster.longest_model_len(model)
        cap = self.settings.max_prompt_tokens
        return PromptLength(cap if engines is None else min(engines, cap), not miscounted)

    def legs_decided(self, legs: LegPlan, model: str, *, counted: bool) -> None:
        """A request of a model with prefill/decode workers: counted by how it is served
        (where `counted`: its front door runs the plan); refused (503) where no prefill
        worker is live and the settings say to refuse."""
        metrics = self.metrics
        if counted:
            split, reason = str(legs.split).lower(), legs.reason
            metrics.child(metrics.legs_decided, split=split, reason=reason).inc()
        if legs.reason is not LegReason.NO_PREFILL_WORKER:
            return
        if self.planner.disaggregation.when_no_prefill == "refuse":
            raise self.refused(
                unavailable(
                    f"model {model!r} has decode workers and no live prefill worker",
                    outcome="no_prefill_worker",
                    retry_after_s=self.settings.retry_after_s,
                )
            )
        metrics.child(metrics.disaggregation_fallbacks, reason="no_prefill_worker").inc()
        if self._no_prefill_warned.get(model, -math.inf) + _NO_PREFILL_WARNING_S < self.clock():
            self._no_prefill_warned[model] = self.clock()
            log.error(
                "model %s has decode workers and no live prefill worker: its requests are "
                "served whole on the decode workers (disaggregation.when_no_prefill)",
                model,
            )

    def no_worker(self, tenant: Tenant) -> RequestRefused:
        message = (
            f"no live worker in tenant {tenant.name!r}'s pool"
            if tenant.isolation == "dedicated" and self.pool.candidates()
            else "no live worker can take the request now"
        )
        return unavailable(message, outcome="no_worker", retry_after_s=self.settings.retry_after_s)


class RequestLifecycle:
    """One admitted request, until `close`."""

    def __init__(self, flow: RequestFlow, tenant: Tenant, where: Placement) -> None:
        self.flow = flow
        self.tenant = tenant
        self.placement = where
        self.attempts = 0  # dispatches so far
        self.flow_pass: FlowPass | None = None  # let through flow control's gate
        self._open: Dispatch | None = None
        self._closed = False

    def traced(self, endpoint: Endpoint) -> AbstractContextManager[trace.Span]:
        """The request's `kvplane.route` span, to hold `route` and what the front door
        does with its answer (the attempts' spans)."""
        return self.flow.tracer.start_as_current_span(
            "kvplane.route",
            attributes={"kvplane.endpoint": endpoint.value, "kvplane.tenant": self.tenant.name},
        )

    async def route(
        self,
        raw: bytes,
        endpoint: Endpoint,
        span: trace.Span = trace.INVALID_SPAN,
        *,
        splits: bool = True,
        waiting_for: WaitWrapper | None = None,
    ) -> RoutedRequest:
        """Parse, tokenise, wait for room where flow control holds the model's requests
        (`waiting_for` wraps the wait), and decide (`span`: the one `traced` opened);
        raises a RequestRefused (counted) where the request cannot go anywhere. `splits`:
        the front door can run a disaggregated request's two legs (else the plan's split
        is not counted, and the request goes whole to its first-ranked worker)."""
        flow, tenant = self.flow, self.tenant
        try:
            parsed = parse_body(raw, endpoint)
        except BadRequest as error:
            raise flow.refused(error) from None
        if flow.gate is not None:
            raw = without_client_priority(raw, parsed)
        span.set_attribute("kvplane.model", parsed.model)
        span.set_attribute("kvplane.stream", parsed.stream)
        scope = key_scope(tenant, parsed)
        length = flow.prompt_length(parsed.model)
        try:
            start = await self._tokenize(parsed, scope, length.limit)
        except PromptTooLong as too_long:
            raise flow.refused(BadRequest(str(too_long), outcome="prompt_too_long")) from None
        deferred = start is not None and start.rest is not None
        if flow.gate is not None and self.flow_pass is None:
            tokens = 0 if start is None else start.estimated_tokens
            try:
                self.flow_pass = await flow.gate.enter(
                    tenant,
                    parsed.model,
                    self.placement,
                    tokens,
                    waiting_for,
                    answer_limit=parsed.answer_limit,
                    answers=parsed.answers,
                    prompts=parsed.prompts,
                )
            except RequestRefused as shed:
                raise flow.refused(shed) from None
        decision, start = await route_prompt(
            flow.planner,
            parsed,
            tenant,
            scope,
            start,
            length.per_worker,
        )
        metrics = flow.metrics
        if deferred:
            when = "before_routing" if start is None or start.rest is None else "after_answer"
            metrics.child(metrics.prompt_rests, tokenised=when).inc()
        metrics.decision_seconds.observe(decision.seconds)
        metrics.child(metrics.decisions, factor=decision.factor).inc()
        if not decision.ranked:
            raise flow.refused(flow.no_worker(tenant))
        if decision.legs is not None:
            flow.legs_decided(decision.legs, parsed.model, counted=splits)
        return RoutedRequest(
            parsed,
            decision,
            body_for_engine(raw, parsed, tenant.cache_salt),
            None if start is None else start.rest,
            engine_priority=0 if self.flow_pass is None else self.flow_pass.engine_priority,
        )

    async def _tokenize(self, parsed: ParsedRequest, scope: str, limit: int) -> PromptStart | None:
        flow = self.flow
        started = time.perf_counter()
        with flow.tracer.start_as_current_span("kvplane.tokenize") as span:
            start = await flow.prompt_tokens.start(parsed, scope, limit, defer_rest=True)
            span.set_attribute("kvplane.prompt_tokens", -1 if start is None else len(start.ids))
        flow.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        return start

    def dispatch(self, routed: RoutedRequest, worker_id: str, leg: Leg = Leg.WHOLE) -> Dispatch:
        """The request (or `leg` of it) goes to `worker_id` (one of routed.worker_ids(),
        or of the decision's prefill workers for a prefill leg): it takes a ticket there
        and its prefix is predicted there, until the dispatch ends."""
        if self._open is not None:
            raise RuntimeError("the previous dispatch has not ended")
        flow, decision = self.flow, routed.decision
        candidate = decision.info(worker_id)
        predicted = decision.predicted_tokens(worker_id)
        # A decode leg computes nothing of the prompt: it pulls what it lacks.
        to_compute = 0 if leg is Leg.DECODE else max(0, decision.prompt_tokens - predicted)
        flow_pass = self.flow_pass
        if flow_pass is not None and flow.gate is not None:
            flow_pass.dispatched(to_compute)
            flow_pass.waits_in_engine = (
                routed.parsed.stream and leg is not Leg.PREFILL and flow.gate.would_wait(worker_id)
            )
        ticket = flow.pool.sent(
            worker_id,
            self.tenant.name,
            to_compute,
            streamed=routed.parsed.stream and leg is not Leg.PREFILL,
        )
        sent = SentTo(
            worker_id=worker_id,
            incarnation=candidate.incarnation,
            model=candidate.model,
            tenant=self.tenant.name,
            decision=decision,
            predicted_tokens=predicted,
            indexed_tokens=decision.indexed_tokens(worker_id),
            dispatched_at=flow.clock(),
            leg=leg,
        )
        flow.planner.routed(decision, worker_id)
        self.attempts += 1
        self._open = Dispatch(self, routed, sent, ticket, candidate.base_url, self.attempts)
        return self._open

    def close(self) -> None:
        """The request has ended, however: its tenant's slot is given back, and a
        dispatch still open (the front door was cancelled) is abandoned. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._open is not None:
                self._open.abandon()
        finally:
            self.flow.limiter.release(self.tenant)
            if self.flow_pass is not None:
                self.flow_pass.close()


class Dispatch:
    """One attempt at one worker, from sent until it ends: settled (the engine answered,
    with whatever status) or abandoned (no answer is coming: the engine failed before its
    first byte, the client left, the router stops)."""

    def __init__(
        self,
        lifecycle: RequestLifecycle,
        routed: RoutedRequest,
        sent: SentTo,
        ticket: Ticket,
        base_url: str,
        attempt: int,
    ) -> None:
        self._lifecycle = lifecycle
        self.routed = routed
        self.sent = sent
        self.ticket = ticket
        self.base_url = base_url
        self.attempt = attempt  # 1 for the first worker tried
        self.sent_at = time.perf_counter()

    @property
    def worker_id(self) -> str:
        return self.sent.worker_id

    @property
    def predicted_tokens(self) -> int:
        return self.sent.predicted_tokens

    @property
    def ended(self) -> bool:
        return self._lifecycle._open is not self

    def first_byte(self) -> None:
        self._lifecycle.flow.pool.first_byte(self.ticket)
        flow_pass = self._lifecycle.flow_pass
        if flow_pass is not None:
            flow_pass.disarm()  # answered: never preempted from now on

    def streamed(self, chunk: bytes) -> None:
        """A chunk of the streamed answer passed (its events' tokens charged as they
        stream, where flow control is on: one event, one token, as engines send)."""
        flow_pass = self._lifecycle.flow_pass
        if flow_pass is not None:
            flow_pass.generated(chunk.count(b"data:"))

    def abandon(self, outcome: str | None = None) -> None:
        """No answer is coming from this worker: its ticket and the prefix predicted
        there go (the engine never cached it, or dropped it with the connection)."""
        if self._end():
            flow = self._lifecycle.flow
            flow.planner.predicted.removed(self.worker_id, self.sent.decision.keys)
            if outcome is not None:
                flow.count(outcome, self.worker_id)

    def failed(self, reason: str, *, refused: bool) -> None:
        """The worker failed before its first byte (`refused`: it refused the
        connection): abandoned, and the next worker may be tried."""
        flow = self._lifecycle.flow
        self.abandon()
        if refused:
            flow.pool.unreachable(self.worker_id)
        flow.metrics.failovers.labels(
            worker=self.worker_id, reason="refused" if refused else "failed"
        ).inc()
        log.warning("worker %s failed before its first byte (%s)", self.worker_id, reason)

    def settle(self, outcome: str, usage: Usage | None, status: int) -> None:
        """The engine answered with `status` (`usage`: what its answer reported, None
        where the front door did not see it)."""
        if self._end():
            self._account(outcome, usage, status)

    def hand_off(self) -> None:
        """The request went on to the worker and the front door will see no more of it
        (the picker, with Envoy's response phase skipped): settled as answered, unseen,
        and the worker's load reports take over its ticket."""
        if self._end(handed_off=True):
            self._account("handed_off", None, 200)

    def _account(self, outcome: str, usage: Usage | None, status: int) -> None:
        flow = self._lifecycle.flow
        if status >= 400:  # the engine refused the request (a 4xx) or failed it
            outcome = "engine_refused" if status < 500 else "engine_error"
        if self.sent.leg is Leg.PREFILL:  # the request is counted once, by its decode leg
            flow.metrics.child(flow.metrics.prefill_legs, outcome=outcome).inc()
        else:
            flow.count(outcome, self.worker_id)
        flow_pass = self._lifecycle.flow_pass
        if flow_pass is not None and usage is not None and usage.completion_tokens is not None:
            flow_pass.generated(usage.completion_tokens - flow_pass.generated_tokens)
        if status >= 400:
            flow.accounting.failed(self.sent, usage)
            return
        prompt_tokens = self.sent.decision.prompt_tokens
        prompt_rest = self.routed.prompt_rest
        if prompt_rest is not None:  # routed on its start: counted whole for the comparisons
            token_ids = prompt_rest()
            prompt_tokens = len(token_ids)
            flow.planner.routed_rest(self.sent.decision, self.worker_id, token_ids)
        flow.accounting.answered(self.sent, prompt_tokens, usage)

    def _end(self, *, handed_off: bool = False) -> bool:
        """The one place a worker's ticket is given back (to the worker's next load
        report, where handed off); False if it was already."""
        lifecycle = self._lifecycle
        if lifecycle._open is not self:
            return False
        lifecycle._open = None
        pool = lifecycle.flow.pool
        if handed_off:
            pool.handed_off(self.ticket)
        else:
            pool.finished(self.ticket)
        return True


async def route_prompt(
    planner: RoutingPlanner,
    parsed: ParsedRequest,
    tenant: Tenant,
    cache_scope: str,
    start: PromptStart | None,
    counted_as_engines: bool,
) -> tuple[Decision, PromptStart | None]:
    """The decision for a prompt, on its start where that cannot choose otherwise than
    the whole would (Decision.rest_could_change_choice); else its rest is tokenised now
    and the whole decides. Returns the prompt as decided on."""
    for _ in range(2):
        tokens: Sequence[int] = [] if start is None else start.ids
        decision = await planner.decide(
            model=parsed.model,
            tenant=tenant,
            cache_scope=cache_scope,
            tokens=tokens,
            counted_as_engines=counted_as_engines,
            more_tokens=0 if start is None else start.estimated_tokens - len(tokens),
            more_tokens_at_most=0 if start is None else start.most_tokens - len(tokens),
        )
        if start is None or not decision.rest_could_change_choice():
            break
        start = start.completed()
    return decision, start
