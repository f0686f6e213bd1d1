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
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Security
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvplane.core.types import WorkerRole
from router.auth import UNAUTHORIZED, TenantKey
from router.errors import RequestRefused, documented, required_header, unavailable
from router.flow_control import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    SHED_REASON_HEADER,
    FlowPass,
)
from router.lifecycle import Dispatch, RequestFlow, RequestLifecycle, RoutedRequest
from router.lifecycle.bodies import (
    BODY_ERRORS,
    BadRequest,
    Endpoint,
    StreamUsage,
    read_body,
    response_usage,
)
from router.lifecycle.legs import (
    REQUEST_ID_HEADER,
    Leg,
    MissingParams,
    decode_leg_body,
    handed_on_params,
    leg_request_id,
    prefill_leg_body,
)
from router.metrics import RouterMetrics
from router.proxy.schema import (
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    StreamEvent,
)
from router.proxy.upstream import (
    AttemptFailed,
    NoFreeConnection,
    Upstream,
    UpstreamAnswer,
    UpstreamBroken,
)
from router.routes import HotRoute
from router.routing.pool import WorkerPool

log = logging.getLogger(__name__)

WORKER_HEADER = "x-kvplane-worker"
CACHED_TOKENS_HEADER = "x-kvplane-cached-tokens"
ATTEMPTS_HEADER = "x-kvplane-attempts"  # workers tried, this one included
PREFILL_WORKER_HEADER = "x-kvplane-prefill-worker"  # a split request's prefill leg's
# ... and the prompt tokens that worker's engine found cached (absent: it did not say).
PREFILL_CACHED_TOKENS_HEADER = "x-kvplane-prefill-cached-tokens"
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
            PREFILL_WORKER_HEADER: {
                "description": "a split request's prefill worker (docs/pd-disaggregation.md)",
                "schema": {"type": "string"},
            },
            PREFILL_CACHED_TOKENS_HEADER: {
                "description": "the prompt tokens the prefill worker's engine found cached",
                "schema": {"type": "integer", "minimum": 0},
            },
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
        "the tenant is over its request rate or its requests in progress, or flow control "
        'shed the request (its engines are saturated: docs/router.md "Flow control")',
        {
            "retry-after": required_header({"type": "integer", "minimum": 1}, "seconds"),
            SHED_REASON_HEADER: {
                "description": "why flow control shed it: queue_full, displaced, "
                "queue_timeout, deadline or preempted",
                "schema": {"type": "string"},
            },
        },
    ),
    503: documented(
        "no live worker, none answered before its first byte, or the router's connections "
        "to the engines are all in use",
        {"retry-after": required_header({"type": "integer", "minimum": 0}, "seconds")},
    ),
}


@dataclass(frozen=True, slots=True)
class _HandedOn:
    """A prefill leg's result: the decode leg's body, and who prefilled."""

    body: bytes
    worker_id: str
    cached_tokens: int | None  # the prompt tokens the prefill engine found cached


def _takes_decode_legs(routed: RoutedRequest, worker_id: str) -> bool:
    info = routed.decision.info(worker_id)
    return info.transfers_kv and info.role is not WorkerRole.PREFILL


class ClientGone(Exception):
    """The client disconnected while the router waited on an engine."""


class Preempted(Exception):
    """A request of a higher band took the attempt's place before its first byte."""


@dataclass(slots=True)
class _Relay:
    """One streamed answer on its way to the client."""

    answer: UpstreamAnswer
    dispatch: Dispatch
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
        self._after_finish: list[Callable[[], None]] = []

    def after_finish(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the answer is sent and settled, however the sending ended."""
        self._after_finish.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                self._settle()
            finally:
                for callback in self._after_finish:
                    callback()


class ProxyService:
    """The OpenAI front door: a request's life (router/lifecycle) with the bytes relayed
    here, and failover to the next ranked worker before the first byte."""

    def __init__(
        self, *, flow: RequestFlow, pool: WorkerPool, upstream: Upstream, metrics: RouterMetrics
    ) -> None:
        self.flow = flow
        self.settings = flow.settings
        self.pool = pool
        self.upstream = upstream
        self.metrics = metrics
        self.tracer = flow.tracer
        self.tenant_key = TenantKey(flow.tenants)

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
        try:
            headers = request.headers
            lifecycle = self.flow.admit(
                headers.get("authorization"),
                headers.get(PRIORITY_HEADER),
                headers.get(DEADLINE_HEADER),
            )
        except RequestRefused as refused:
            return refused.response()
        try:
            response = await self._admitted(request, endpoint, lifecycle)
        except BaseException:
            lifecycle.close()
            raise
        if isinstance(response, (RelayResponse, WholeAnswerResponse)):
            response.after_finish(lifecycle.close)
        else:
            lifecycle.close()
        return response

    async def _admitted(
        self, request: Request, endpoint: Endpoint, lifecycle: RequestLifecycle
    ) -> Response:
        try:
            raw = await read_body(request, self.settings.max_body_bytes)
        except BadRequest as error:
            return self.flow.refused(error).response()
        except ClientDisconnect:
            self.flow.count("client_disconnected")
            return Response(status_code=499)
        try:
            with lifecycle.traced(endpoint) as span:
                routed = await lifecycle.route(
                    raw,
                    endpoint,
                    span,
                    waiting_for=functools.partial(_unless_disconnected, request),
                )
                return await self._forward(request, lifecycle, routed)
        except RequestRefused as refused:  # counted where raised
            return refused.response()
        except ClientGone:  # while it waited for room (flow control)
            self.flow.count("client_disconnected")
            return Response(status_code=499)

    async def _forward(
        self, request: Request, lifecycle: RequestLifecycle, routed: RoutedRequest
    ) -> Response:
        parsed = routed.parsed
        headers = {"content-type": "application/json"}
        failures: list[str] = []
        body, leg, prefill_worker = routed.body, Leg.WHOLE, None
        prefill_cached: int | None = None
        legs = routed.decision.legs
        if legs is not None and legs.split:
            headers[REQUEST_ID_HEADER] = leg_request_id()
            try:
                handed_on = await self._prefill_leg(request, lifecycle, routed, headers)
            except ClientGone:
                self.flow.count("client_disconnected")
                return Response(status_code=499)
            if handed_on is not None:
                body, leg, prefill_worker = handed_on.body, Leg.DECODE, handed_on.worker_id
                prefill_cached = handed_on.cached_tokens
        workers = deque(routed.worker_ids(self.settings.max_attempts))
        while workers:
            worker_id = workers.popleft()
            if leg is Leg.DECODE and not _takes_decode_legs(routed, worker_id):
                # A failover to a worker that cannot pull: it computes the prompt.
                body, leg, prefill_worker = routed.body, Leg.WHOLE, None
            dispatch = lifecycle.dispatch(routed, worker_id, leg)
            url = dispatch.base_url.rstrip("/") + parsed.endpoint.value
            try:
                with self.tracer.start_as_current_span(
                    "kvplane.upstream",
                    attributes={
                        "kvplane.worker": worker_id,
                        "kvplane.attempt": len(failures),
                        "kvplane.leg": leg.value,
                    },
                ) as span:
                    sent = routed.engine_body(body, [worker_id])
                    flow_pass = lifecycle.flow_pass
                    answer, full_body = await _unless_disconnected(
                        request,
                        self._attempt(url, sent, headers, parsed.stream, dispatch),
                        flow_pass if flow_pass is not None and flow_pass.waits_in_engine else None,
                    )
                    first_byte_s = time.perf_counter() - dispatch.sent_at
                    span.set_attribute("kvplane.first_byte_ms", first_byte_s * 1000)
                    span.set_attribute("http.response.status_code", answer.status)
            except AttemptFailed as failure:
                if leg is Leg.DECODE and failure.status is not None:
                    # vLLM's answer to a pull that failed under kv_load_failure_policy
                    # "fail" (the prefill's lease ran out, the transfer broke): the same
                    # worker computes the prompt itself instead.
                    dispatch.abandon()
                    self._fallback("kv_load_failed", worker_id, failure.status)
                    body, leg, prefill_worker = routed.body, Leg.WHOLE, None
                    workers.appendleft(worker_id)
                    continue
                dispatch.failed(failure.reason, refused=failure.refused)
                failures.append(f"{worker_id}: {failure.reason}")
                continue
            except NoFreeConnection:
                dispatch.abandon()
                raise self._router_busy() from None
            except ClientGone:
                dispatch.abandon("client_disconnected")
                return Response(status_code=499)
            except Preempted:
                dispatch.abandon()
                assert lifecycle.flow_pass is not None
                raise self.flow.refused(lifecycle.flow_pass.shed().error()) from None
            if parsed.stream:  # a non-streamed answer's first byte is its last
                self.metrics.first_byte_seconds.observe(first_byte_s)
            outcome = "ok" if dispatch.attempt == 1 else "ok_after_failover"
            response_headers = dict(answer.headers)
            response_headers[WORKER_HEADER] = worker_id
            response_headers[CACHED_TOKENS_HEADER] = str(dispatch.predicted_tokens)
            response_headers[ATTEMPTS_HEADER] = str(dispatch.attempt)
            if prefill_worker is not None:
                response_headers[PREFILL_WORKER_HEADER] = prefill_worker
                if prefill_cached is not None:
                    response_headers[PREFILL_CACHED_TOKENS_HEADER] = str(prefill_cached)
            if full_body is not None:
                return WholeAnswerResponse(
                    full_body,
                    settle=functools.partial(
                        dispatch.settle, outcome, response_usage(full_body), answer.status
                    ),
                    status_code=answer.status,
                    headers=response_headers,
                )
            relay = _Relay(answer, dispatch)
            return RelayResponse(
                self._relay(relay, outcome),
                finish=functools.partial(self._finish, relay),
                client_left=functools.partial(self._client_left, relay),
                status_code=answer.status,
                headers=response_headers,
            )
        log.warning("no worker answered before the first byte: %s", "; ".join(failures))
        raise self.flow.refused(
            unavailable(
                f"no worker answered ({len(failures)} tried): " + "; ".join(failures),
                outcome="all_attempts_failed",
                retry_after_s=self.settings.retry_after_s,
            )
        )

    async def _prefill_leg(
        self,
        request: Request,
        lifecycle: RequestLifecycle,
        routed: RoutedRequest,
        headers: dict[str, str],
    ) -> _HandedOn | None:
        """A split request's prefill leg, on its prefill workers in turn: the decode
        leg's body, with the KV the prefill handed on; None where the request is to be
        served whole instead (every prefill worker failed, or one refused the request or
        handed nothing on), counted with the reason."""
        parsed, salt = routed.parsed, lifecycle.tenant.cache_salt
        leg_body = prefill_leg_body(parsed, salt)
        url_path = parsed.endpoint.value
        for worker_id in routed.decision.prefill_worker_ids(self.settings.max_attempts):
            body = routed.engine_body(leg_body, [worker_id])
            dispatch = lifecycle.dispatch(routed, worker_id, Leg.PREFILL)
            try:
                with self.tracer.start_as_current_span(
                    "kvplane.prefill_leg", attributes={"kvplane.worker": worker_id}
                ) as span:
                    answer, full_body = await _unless_disconnected(
                        request,
                        self._attempt(
                            dispatch.base_url.rstrip("/") + url_path, body, headers, False, dispatch
                        ),
                    )
                    span.set_attribute("http.response.status_code", answer.status)
            except AttemptFailed as failure:
                dispatch.failed(failure.reason, refused=failure.refused)
                continue
            except NoFreeConnection:
                dispatch.abandon()
                raise self._router_busy() from None
            except ClientGone:
                dispatch.abandon()
                raise
            assert full_body is not None  # a prefill leg is never streamed
            usage = response_usage(full_body)
            dispatch.settle("ok", usage, answer.status)
            if answer.status >= 400:
                # Refused (its failures raise AttemptFailed): served whole, so that the
                # client gets the decode worker's own answer, or refusal.
                self._fallback("prefill_refused", worker_id, answer.status)
                return None
            try:
                params = handed_on_params(full_body)
            except MissingParams as missing:
                self._fallback("no_kv_params", worker_id, answer.status, str(missing))
                return None
            cached = None if usage is None else usage.cached_tokens
            return _HandedOn(decode_leg_body(parsed, salt, params), worker_id, cached)
        self._fallback("prefill_failed", None, None)
        return None

    def _fallback(
        self, reason: str, worker_id: str | None, status: int | None, detail: str = ""
    ) -> None:
        """A split request that does not run as planned: counted, and said (ids and
        counts only)."""
        self.metrics.child(self.metrics.disaggregation_fallbacks, reason=reason).inc()
        log.warning(
            "disaggregated request served otherwise (%s): worker %s, status %s%s",
            reason,
            worker_id or "-",
            status if status is not None else "-",
            f": {detail}" if detail else "",
        )

    def _router_busy(self) -> RequestRefused:
        log.warning("no free upstream connection (proxy.max_connections is reached)")
        return self.flow.refused(
            unavailable(
                "the router has no free connection to the engines now",
                outcome="router_busy",
                retry_after_s=self.settings.retry_after_s,
            )
        )

    async def _attempt(
        self, url: str, body: bytes, headers: dict[str, str], stream: bool, dispatch: Dispatch
    ) -> tuple[UpstreamAnswer, bytes | None]:
        """The engine's answer up to its first byte; for a non-streamed request, all of
        it (nothing has reached the client yet, so a break is still a failed attempt)."""
        answer = await self.upstream.send(url, body, headers, self.settings.first_byte_timeout_s)
        dispatch.first_byte()
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

    async def _relay(self, relay: _Relay, outcome: str) -> AsyncIterator[bytes]:
        answer = relay.answer
        try:
            chunk = answer.first_chunk
            streamed = relay.dispatch.streamed if self.flow.gate is not None else None
            while chunk:
                relay.usage.feed(chunk)
                if streamed is not None:
                    streamed(chunk)
                yield chunk
                chunk = await answer.next_chunk()
            relay.outcome = outcome
        except UpstreamBroken as error:
            if relay.client_left:
                return  # its answer was stopped for it
            # Bytes went out already: no retry. Say so in the stream's own error form,
            # so that the client sees a failure, not a short answer.
            relay.outcome = "broken_stream"
            log.warning("worker %s broke a stream (%s)", relay.dispatch.worker_id, error)
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
        """Close the engine's answer and settle the request, once, however the stream
        ended."""
        if relay.finished:
            return
        relay.finished = True
        try:
            await relay.answer.close()
        finally:
            relay.dispatch.settle(relay.outcome, relay.usage.usage(), relay.answer.status)


async def _unless_disconnected(
    request: Request, work: Awaitable[_T], preemptible: FlowPass | None = None
) -> _T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (which
    closes the engine's connection, so the engine drops the request) and ClientGone
    is raised. With `preemptible`, flow control may cancel it as well, until its first
    byte (Preempted). (The watcher cancels `work` from a done-callback: asyncio.wait
    would cost each request a waiter and a callback a task, about 30 µs on the 2-core
    machine.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(lambda _: task.cancel())  # a no-op once `task` is done
    if preemptible is not None:
        preemptible.arm(task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        # The client left, or flow control preempted it, unless this request itself is
        # being cancelled (the server stopping), which cancels `task` with it.
        current = asyncio.current_task()
        if not (current and current.cancelling()):
            if watcher.done() and not watcher.cancelled():
                raise ClientGone from None
            if preemptible is not None and preemptible.preempted:
                raise Preempted from None
        raise
    finally:
        watcher.cancel()
        if preemptible is not None:
            preemptible.disarm()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
