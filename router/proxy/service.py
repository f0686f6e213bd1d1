"""The OpenAI-compatible endpoints: authenticate, tokenise, decide, forward, account.

`POST /v1/completions` and `POST /v1/chat/completions` go to the best-scoring worker
serving the request's model; `GET /v1/models` lists the models live workers serve.
Every answer carries `x-kvplane-worker`, `x-kvplane-cached-tokens` (the cached prefix
the router predicted there) and `x-kvplane-attempts` (how many workers it tried). Before
an engine's first byte reaches the client the router may try the next worker; after it,
never.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Security
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvplane.core.clock import Clock
from kvplane.core.config import ProxySettings
from router.auth import UNAUTHORIZED, TenantKey, unauthorized
from router.errors import documented, error_response, required_header
from router.metrics import NO_WORKER, RouterMetrics
from router.proxy.bodies import (
    BODY_ERRORS,
    BadRequest,
    Endpoint,
    ParsedRequest,
    StreamUsage,
    Usage,
    body_for_engine,
    key_scope,
    parse_body,
    read_body,
    response_usage,
)
from router.proxy.schema import (
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    StreamEvent,
)
from router.proxy.tokens import PromptLength, PromptStart, PromptTokens, PromptTooLong
from router.proxy.upstream import (
    AttemptFailed,
    NoFreeConnection,
    Upstream,
    UpstreamAnswer,
    UpstreamBroken,
)
from router.routes import HotRoute
from router.routing.accuracy import PredictionAccuracy, Verdict
from router.routing.decide import Decision, RoutingPlanner
from router.routing.funnel import CacheFunnel, funnel_step
from router.routing.hot_prefixes import HotPrefixes
from router.routing.pool import Ticket, WorkerPool
from router.routing.token_agreement import TokenCountAgreement
from router.tenant_limits import TenantLimiter
from router.tenants import Tenant, TenantDirectory
from router.tracing import Tracer

log = logging.getLogger(__name__)

WORKER_HEADER = "x-kvplane-worker"
CACHED_TOKENS_HEADER = "x-kvplane-cached-tokens"
ATTEMPTS_HEADER = "x-kvplane-attempts"  # workers tried, this one included
_T = TypeVar("_T")

_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": Completion,
        "description": "the engine's answer; `text/event-stream` when `stream` is true",
        "headers": {
            WORKER_HEADER: required_header({"type": "string"}, "the worker that answered"),
            CACHED_TOKENS_HEADER: required_header(
                {"type": "integer", "minimum": 0}, "the cached prefix the router predicted there"
            ),
            ATTEMPTS_HEADER: required_header(
                {"type": "integer", "minimum": 1}, "the workers tried, this one included"
            ),
        },
        "content": {"text/event-stream": {"schema": StreamEvent.model_json_schema()}},
    },
    400: documented(
        "refused by the router (not JSON, not an object, `model`, `stream`, `prompt` or "
        "`messages`; a prompt over the model's maximum length) or by the engine (its own "
        "checks)"
    ),
    401: UNAUTHORIZED,
    404: documented("the engine does not serve the model"),
    413: BODY_ERRORS[413],
    429: documented(
        "the tenant is over its request rate or its requests in progress",
        {"retry-after": required_header({"type": "integer", "minimum": 1}, "seconds")},
    ),
    503: documented(
        "no live worker, none answered before its first byte, or the router's connections "
        "to the engines are all in use",
        {"retry-after": required_header({"type": "integer", "minimum": 0}, "seconds")},
    ),
}


class ClientGone(Exception):
    """The client disconnected while the router waited on an engine."""


@dataclass(slots=True)
class _Exchange:
    """One proxied request's facts, for the accounting when it ends."""

    worker_id: str
    incarnation: int
    model: str  # the worker's, as its agent registered it
    predicted_tokens: int  # what x-kvplane-cached-tokens said
    indexed_tokens: int  # the part of it the index vouched for: what is judged
    prompt_tokens: int  # the router's count (0: it could not tokenise the prompt)
    ticket: Ticket
    sent_at: float
    tenant: str
    decision: Decision  # for the funnel, read when the answer is settled
    dispatched_at: float  # on the router's clock, as evictions are recorded
    # The prompt's whole ids, where it was routed on its start: tokenised once the
    # answer is settled, for the count and the predicted entries (None: whole already).
    prompt_rest: Callable[[], Sequence[int]] | None


@dataclass(slots=True)
class _Relay:
    """One streamed answer on its way to the client."""

    answer: UpstreamAnswer
    exchange: _Exchange
    usage: StreamUsage = field(default_factory=StreamUsage)
    outcome: str = "client_disconnected"  # until the stream ends otherwise
    client_left: bool = False
    finished: bool = False


class RelayResponse(StreamingResponse):
    """A streamed answer, sent on as the engine's chunks arrive.

    `finish` runs however the response ends: a client that leaves before the first
    chunk goes out can end the response before its generator runs at all, and a
    generator that never ran never reaches its `finally` (the engine's connection, the
    router's connection slot and the worker's in-flight count would stay taken).
    `client_left` runs when the client goes away mid-stream: it stops the engine's
    answer, which ends the generator.

    Starlette's own streaming costs a task group a response (a task to stream, one to
    listen for the client) and a pass through its middleware a chunk; this costs one
    task watching for the client, and none under a server whose `send` raises when the
    client is gone (ASGI 2.4)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        finish: Callable[[], Awaitable[None]],
        client_left: Callable[[], Awaitable[None]],
        **kw: Any,
    ) -> None:
        super().__init__(content, **kw)
        self._finish = finish
        self._client_left = client_left
        self._after_finish: list[Callable[[], None]] = []

    def after_finish(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the response has ended, however it ended."""
        self._after_finish.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        watcher = None
        if tuple(int(part) for part in spec.split(".")) < (2, 4):
            watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # an ASGI 2.4 server's word that the client is gone
            raise ClientDisconnect from None
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            try:
                await self._finish()
            finally:
                for callback in self._after_finish:
                    callback()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        await self._client_left()


class WholeAnswerResponse(Response):
    """An engine's whole answer (not streamed), accounted for once it is sent, however
    the sending ends: the client gets its bytes before the router's bookkeeping, which
    no other request can observe in between (nothing here awaits after the body)."""

    def __init__(self, content: bytes, *, settle: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._settle()


class ProxyService:
    def __init__(
        self,
        *,
        settings: ProxySettings,
        tenants: TenantDirectory,
        pool: WorkerPool,
        planner: RoutingPlanner,
        accuracy: PredictionAccuracy,
        agreement: TokenCountAgreement,
        upstream: Upstream,
        metrics: RouterMetrics,
        tracer: Tracer,
        limiter: TenantLimiter,
        funnel: CacheFunnel,
        hot_prefixes: HotPrefixes,
        clock: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.limiter = limiter
        self.funnel = funnel
        self.hot_prefixes = hot_prefixes
        self.clock = clock  # the router's, on which evictions are recorded
        self.tenants = tenants
        self.pool = pool
        self.planner = planner
        self.accuracy = accuracy
        self.agreement = agreement
        self.upstream = upstream
        self.metrics = metrics
        self.tracer = tracer
        self.prompt_tokens = PromptTokens(settings)
        self.tenant_key = TenantKey(tenants)
        # Worker incarnations seen sending prompt_tokens_details: from them, usage
        # without it means no cached tokens (vLLM leaves it out at zero).
        self._reporting_workers: set[tuple[str, int]] = set()
        # Per model, the worker incarnations whose engines count prompts otherwise than
        # this router: its token counts cannot be held against their max_model_len.
        self._miscounting: dict[str, set[tuple[str, int]]] = {}

    def routes(self) -> list[APIRoute]:
        async def models() -> ModelList:
            return ModelList(data=[ModelCard(id=model) for model in self.pool.models()])

        return [
            self._generation(Endpoint.COMPLETIONS, CompletionRequest, "a completion"),
            self._generation(Endpoint.CHAT, ChatCompletionRequest, "a chat completion"),
            APIRoute(
                "/v1/models",
                models,
                methods=["GET"],
                summary="the models live workers serve",
                dependencies=[Security(self.tenant_key)],
                responses={401: UNAUTHORIZED},
            ),
        ]

    def _generation(self, endpoint: Endpoint, body: type[BaseModel], summary: str) -> HotRoute:
        async def generate(request: Request) -> Response:
            return await self.proxy(request, endpoint)

        return HotRoute(
            endpoint.value,
            generate,
            body=body,
            name=endpoint.name.lower(),
            methods=["POST"],
            summary=summary,
            description=(
                "Routed to the worker holding most of the prompt's prefix, net of load; "
                "the engine's answer (and its errors) come back unchanged."
            ),
            openapi_extra={"security": self.tenant_key.requirement()},
            responses=_GENERATION_RESPONSES,
        )

    async def proxy(self, request: Request, endpoint: Endpoint) -> Response:
        tenant = self.tenant_key.tenant(request)
        if tenant is None:
            self._count("unauthorized")
            return unauthorized().response()
        refused = self.limiter.admit(tenant)  # before the body is read: a refusal costs nothing
        if refused is not None:
            self._count(refused.reason)
            return refused.error().response()
        try:
            response = await self._admitted(request, endpoint, tenant)
        except BaseException:
            self.limiter.release(tenant)
            raise
        if isinstance(response, RelayResponse):
            response.after_finish(functools.partial(self.limiter.release, tenant))
        else:
            self.limiter.release(tenant)
        return response

    async def _admitted(self, request: Request, endpoint: Endpoint, tenant: Tenant) -> Response:
        try:
            raw = await read_body(request, self.settings.max_body_bytes)
            parsed = parse_body(raw, endpoint)
        except BadRequest as error:
            self._count("bad_request")
            return error.response()
        except ClientDisconnect:
            self._count("client_disconnected")
            return Response(status_code=499)
        with self.tracer.start_as_current_span(
            "kvplane.route",
            attributes={
                "kvplane.endpoint": endpoint.value,
                "kvplane.model": parsed.model,
                "kvplane.tenant": tenant.name,
                "kvplane.stream": parsed.stream,
            },
        ):
            scope = key_scope(tenant, parsed)
            length = self.prompt_length(parsed.model)
            try:
                start = await self._tokenize(parsed, scope, length.limit)
            except PromptTooLong as too_long:
                self._count("prompt_too_long")
                return error_response(400, str(too_long), kind="BadRequestError")
            deferred = start is not None and start.rest is not None
            decision, start = await route_prompt(
                self.planner, parsed, tenant, scope, start, length.per_worker
            )
            if deferred:
                when = "before_routing" if start is None or start.rest is None else "after_answer"
                self.metrics.child(self.metrics.prompt_rests, tokenised=when).inc()
            self.metrics.decision_seconds.observe(decision.seconds)
            self.metrics.child(self.metrics.decisions, factor=decision.factor).inc()
            if not decision.ranked:
                return self._no_worker(tenant)
            body = body_for_engine(raw, parsed, tenant.cache_salt)
            rest = None if start is None else start.rest
            return await self._forward(request, parsed, tenant, decision, body, rest)

    async def _tokenize(self, parsed: ParsedRequest, scope: str, limit: int) -> PromptStart | None:
        started = time.perf_counter()
        with self.tracer.start_as_current_span("kvplane.tokenize") as span:
            start = await self.prompt_tokens.start(parsed, scope, limit, defer_rest=True)
            span.set_attribute("kvplane.prompt_tokens", -1 if start is None else len(start.ids))
        self.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        return start

    def prompt_length(self, model: str) -> PromptLength:
        """How long `model`'s prompts may be. The limit: the longest any of its engines
        takes and the configured cap, the lower; the cap alone while the engines' length
        is unknown. The engines' lengths are left out while one of them counts prompts
        otherwise than this router (another tokenizer): the router's count would refuse
        prompts the engines take."""
        miscounted = self._counts_otherwise(model)
        engines = None if miscounted else self.pool.roster.longest_model_len(model)
        cap = self.settings.max_prompt_tokens
        return PromptLength(cap if engines is None else min(engines, cap), not miscounted)

    def _counts_otherwise(self, model: str) -> bool:
        """Whether an engine of `model` counts prompts otherwise than this router now.
        Its agreement window says so: the reaper drops the windows of workers that left
        or restarted, and with them their say here."""
        incarnations = self._miscounting.get(model)
        if not incarnations:
            return False
        incarnations -= {i for i in incarnations if not self.agreement.of(i).disagrees}
        return bool(incarnations)

    def _no_worker(self, tenant: Tenant) -> Response:
        self._count("no_worker")
        message = (
            f"no live worker in tenant {tenant.name!r}'s pool"
            if tenant.isolation == "dedicated" and self.pool.candidates()
            else "no live worker can take the request now"
        )
        return error_response(
            503,
            message,
            kind="ServiceUnavailableError",
            headers={"retry-after": str(self.settings.retry_after_s)},
        )

    async def _forward(
        self,
        request: Request,
        parsed: ParsedRequest,
        tenant: Tenant,
        decision: Decision,
        body: bytes,
        prompt_rest: Callable[[], Sequence[int]] | None,
    ) -> Response:
        path = parsed.endpoint.value
        headers = {"content-type": "application/json"}
        failures: list[str] = []
        ranked = decision.ranked
        for attempt in range(min(len(ranked), self.settings.max_attempts)):
            candidate = decision.info(ranked.worker_id(attempt))
            predicted = decision.predicted_tokens(candidate.worker_id)
            exchange = _Exchange(
                worker_id=candidate.worker_id,
                incarnation=candidate.incarnation,
                model=candidate.model,
                predicted_tokens=predicted,
                indexed_tokens=decision.indexed_tokens(candidate.worker_id),
                prompt_tokens=decision.prompt_tokens,
                ticket=self.pool.sent(
                    candidate.worker_id,
                    tenant.name,
                    max(0, decision.prompt_tokens - predicted),
                    streamed=parsed.stream,
                ),
                sent_at=time.perf_counter(),
                tenant=tenant.name,
                decision=decision,
                dispatched_at=self.clock(),
                prompt_rest=prompt_rest,
            )
            self.planner.routed(decision, candidate.worker_id)
            url = candidate.base_url.rstrip("/") + path
            try:
                with self.tracer.start_as_current_span(
                    "kvplane.upstream",
                    attributes={"kvplane.worker": candidate.worker_id, "kvplane.attempt": attempt},
                ) as span:
                    answer, full_body = await _unless_disconnected(
                        request, self._attempt(url, body, headers, parsed.stream, exchange)
                    )
                    first_byte_s = time.perf_counter() - exchange.sent_at
                    span.set_attribute("kvplane.first_byte_ms", first_byte_s * 1000)
                    span.set_attribute("http.response.status_code", answer.status)
            except AttemptFailed as failure:
                self._abandoned(exchange, decision, failure)
                failures.append(f"{candidate.worker_id}: {failure.reason}")
                continue
            except NoFreeConnection:
                self.pool.finished(exchange.ticket)
                self.planner.predicted.removed(exchange.worker_id, decision.keys)
                self._count("router_busy")
                log.warning("no free upstream connection (proxy.max_connections is reached)")
                return error_response(
                    503,
                    "the router has no free connection to the engines now",
                    kind="ServiceUnavailableError",
                    headers={"retry-after": str(self.settings.retry_after_s)},
                )
            except ClientGone:
                self.pool.finished(exchange.ticket)
                self._count("client_disconnected", candidate.worker_id)
                return Response(status_code=499)
            except BaseException:  # cancelled (the server stopping): release the ticket
                self.pool.finished(exchange.ticket)
                raise
            if parsed.stream:  # a non-streamed answer's first byte is its last
                self.metrics.first_byte_seconds.observe(first_byte_s)
            outcome = "ok" if attempt == 0 else "ok_after_failover"
            response_headers = dict(answer.headers)
            response_headers[WORKER_HEADER] = candidate.worker_id
            response_headers[CACHED_TOKENS_HEADER] = str(predicted)
            response_headers[ATTEMPTS_HEADER] = str(attempt + 1)
            if full_body is not None:
                return WholeAnswerResponse(
                    full_body,
                    settle=functools.partial(
                        self._settled,
                        exchange,
                        outcome,
                        response_usage(full_body),
                        answer.status,
                    ),
                    status_code=answer.status,
                    headers=response_headers,
                )
            relay = _Relay(answer, exchange)
            return RelayResponse(
                self._relay(relay, outcome),
                finish=functools.partial(self._finish, relay),
                client_left=functools.partial(self._client_left, relay),
                status_code=answer.status,
                headers=response_headers,
            )
        self._count("all_attempts_failed")
        log.warning("no worker answered before the first byte: %s", "; ".join(failures))
        return error_response(
            503,
            f"no worker answered ({len(failures)} tried): " + "; ".join(failures),
            kind="ServiceUnavailableError",
            headers={"retry-after": str(self.settings.retry_after_s)},
        )

    async def _attempt(
        self, url: str, body: bytes, headers: dict[str, str], stream: bool, exchange: _Exchange
    ) -> tuple[UpstreamAnswer, bytes | None]:
        """The engine's answer up to its first byte; for a non-streamed request, all of
        it (nothing has reached the client yet, so a break is still a failed attempt)."""
        answer = await self.upstream.send(url, body, headers, self.settings.first_byte_timeout_s)
        self.pool.first_byte(exchange.ticket)
        if stream:
            return answer, None
        try:
            chunks = [answer.first_chunk]
            async for chunk in answer.rest():
                chunks.append(chunk)
        except UpstreamBroken as error:
            raise AttemptFailed(f"broken mid-answer ({error})") from None
        finally:
            await answer.close()
        return answer, b"".join(chunks)

    def _abandoned(self, exchange: _Exchange, decision: Decision, failure: AttemptFailed) -> None:
        self.pool.finished(exchange.ticket)
        self.planner.predicted.removed(exchange.worker_id, decision.keys)
        if failure.refused:
            self.pool.unreachable(exchange.worker_id)
        self.metrics.failovers.labels(
            worker=exchange.worker_id, reason="refused" if failure.refused else "failed"
        ).inc()
        log.warning(
            "worker %s failed before its first byte (%s)", exchange.worker_id, failure.reason
        )

    async def _relay(self, relay: _Relay, outcome: str) -> AsyncIterator[bytes]:
        answer = relay.answer
        try:
            chunk = answer.first_chunk
            while chunk:
                relay.usage.feed(chunk)
                yield chunk
                chunk = await answer.next_chunk()
            relay.outcome = outcome
        except UpstreamBroken as error:
            if relay.client_left:
                return  # its answer was stopped for it
            # Bytes went out already: no retry. Say so in the stream's own error form,
            # so that the client sees a failure, not a short answer.
            relay.outcome = "broken_stream"
            log.warning("worker %s broke a stream (%s)", relay.exchange.worker_id, error)
            message = {"error": {"message": "the engine broke the stream", "code": 502}}
            yield b"data: " + msgspec.json.encode(message) + b"\n\n"
        finally:
            await self._finish(relay)

    async def _client_left(self, relay: _Relay) -> None:
        """The client went away mid-stream: close the engine's answer, which cancels the
        request there and ends the relay."""
        relay.client_left = True
        await relay.answer.close()

    async def _finish(self, relay: _Relay) -> None:
        """Close the engine's answer and account for it, once, however the stream ended."""
        if relay.finished:
            return
        relay.finished = True
        try:
            await relay.answer.close()
        finally:
            self._settled(relay.exchange, relay.outcome, relay.usage.usage(), relay.answer.status)

    def _settled(self, exchange: _Exchange, outcome: str, usage: Usage | None, status: int) -> None:
        self.pool.finished(exchange.ticket)
        if status >= 400:  # the engine refused the request (a 4xx) or failed it
            outcome = "engine_refused" if status < 500 else "engine_error"
        self._count(outcome, exchange.worker_id)
        if exchange.prompt_rest is not None and status < 400:  # routed on its start
            token_ids = exchange.prompt_rest()  # counted whole, for the comparisons below
            exchange.prompt_tokens = len(token_ids)
            self.planner.routed_rest(exchange.decision, exchange.worker_id, token_ids)
        worker = exchange.worker_id
        if status < 400 and usage is not None:
            self._compare_token_counts(exchange, usage)
        reported = self._reported_cached_tokens((worker, exchange.incarnation), usage)
        if status < 400 and exchange.prompt_tokens:
            self._through_funnel(exchange, reported)
        if reported is None:
            if status < 400:
                self.metrics.prefill_tokens_saved.inc(exchange.predicted_tokens)
            return
        self.metrics.prefill_tokens_saved.inc(reported)
        self.metrics.child(self.metrics.predicted_cached_tokens, worker=worker).inc(
            exchange.predicted_tokens
        )
        self_predicted = exchange.predicted_tokens - exchange.indexed_tokens
        self.metrics.child(self.metrics.self_predicted_cached_tokens, worker=worker).inc(
            self_predicted
        )
        self.metrics.child(self.metrics.reported_cached_tokens, worker=worker).inc(reported)
        verdict = self.accuracy.observe(
            worker,
            exchange.incarnation,
            exchange.indexed_tokens,
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
                exchange.predicted_tokens,
                reported,
            )

    def _through_funnel(self, exchange: _Exchange, reported: int | None) -> None:
        """Add the request to the funnel's totals (the metrics read them at scrape time)
        and its longest match to the hot prefixes."""
        decision, worker = exchange.decision, exchange.worker_id
        longest = decision.longest_match()
        if longest is not None:
            self.hot_prefixes.matched(exchange.tenant, longest.key, longest.tokens)
        evicted_at = self.pool.evictions.recorded(worker)[1]
        step = funnel_step(
            prompt_tokens=exchange.prompt_tokens,
            attainable_tokens=0 if longest is None else longest.tokens,
            predicted_tokens=exchange.predicted_tokens,
            predicted_off_device_tokens=decision.off_device_tokens(worker),
            holder_eligible=longest is None or longest.holder_eligible,
            achieved_tokens=reported,
            evicted_meanwhile=evicted_at > exchange.dispatched_at,
        )
        self.funnel.add(exchange.model, exchange.tenant, worker, step)

    def _compare_token_counts(self, exchange: _Exchange, usage: Usage) -> None:
        """The router's prompt token count against the engine's (see
        router/routing/token_agreement.py)."""
        if not exchange.prompt_tokens or usage.prompt_tokens is None:
            return
        worker = exchange.worker_id
        incarnation = (worker, exchange.incarnation)
        matched = self.agreement.observe(incarnation, exchange.prompt_tokens, usage.prompt_tokens)
        miscounting = self._miscounting.setdefault(exchange.model, set())
        if self.agreement.of(incarnation).disagrees:
            miscounting.add(incarnation)
        else:
            miscounting.discard(incarnation)
        self.metrics.child(
            self.metrics.prompt_token_checks,
            worker=worker,
            model=exchange.model,
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
                exchange.model,
                usage.prompt_tokens,
                exchange.prompt_tokens,
                agreement.mismatches,
                agreement.samples,
            )

    def _reported_cached_tokens(
        self, incarnation: tuple[str, int], usage: Usage | None
    ) -> int | None:
        if usage is None:
            return None
        if usage.cached_tokens is not None:
            self._reporting_workers.add(incarnation)
            return usage.cached_tokens
        return 0 if incarnation in self._reporting_workers else None

    def _count(self, outcome: str, worker: str = NO_WORKER) -> None:
        self.metrics.child(self.metrics.requests, outcome=outcome, worker=worker).inc()


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


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (which
    closes the engine's connection, so the engine drops the request) and ClientGone
    is raised. (The watcher cancels `work` from a done-callback: asyncio.wait would
    cost each request a waiter and a callback a task, about 30 µs on the 2-core
    machine.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(lambda _: task.cancel())  # a no-op once `task` is done
    try:
        return await task
    except asyncio.CancelledError:
        # The client left, unless this request itself is being cancelled (the server
        # stopping), which cancels `task` with it.
        current = asyncio.current_task()
        if watcher.done() and not watcher.cancelled() and not (current and current.cancelling()):
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
