"""The gateway's endpoint picker: Envoy's ext_proc service as a front door over a
request's life (router/lifecycle), as the embedded proxy is one; Envoy moves the bytes.

One gRPC stream is one HTTP request. The picker reads the request's headers and body,
admits and routes it exactly as the proxy does, and answers where it goes (the ranked
workers' addresses: the choice, then fallbacks) with the body to send there (the
tenant's cache salt added). Envoy's body modes:
- FULL_DUPLEX_STREAMED (llm-d, Istio, Envoy AI Gateway): the headers go unanswered
  until the body's end, then one headers answer and the body back in chunks;
- BUFFERED: the headers answered as they are, then one answer to the whole body.

What the proxy learns from the answer, the picker learns from what Envoy sends after
the request phase, if anything (docs/picker.md): the response's headers (its status,
the first byte, the endpoint Envoy served) and body (the usage) where Envoy is set to
send them, else the stream's end, which Envoy holds open until the request is done.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)

from router.errors import RequestRefused, unavailable
from router.flow_control import DEADLINE_HEADER, PRIORITY_HEADER
from router.lifecycle import Dispatch, RequestFlow, RequestLifecycle, RoutedRequest
from router.lifecycle.bodies import (
    ENGINE_PRIORITY_HEADER,
    BadRequest,
    Endpoint,
    StreamUsage,
    response_usage,
)
from router.picker.protocol import (
    DESTINATION_HEADER,
    DESTINATION_NAMESPACE,
    destination_on_body,
    destination_on_headers,
    endpoint_of,
    go_on_with_headers,
    refusal,
    request_headers,
    streamed_body,
    subset_hint,
)

log = logging.getLogger(__name__)

SERVED_KEY = DESTINATION_HEADER + "-served"
_ENDPOINTS = {endpoint.value: endpoint for endpoint in Endpoint}
_FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_NO_BODY = ProcessingMode.BodySendMode.NONE
_WHOLE_ANSWER_BYTES = 8 << 20  # past this, a non-streamed answer's usage goes unread


class _Refused(Exception):
    """The request is refused: the picker's last word on this stream (counted)."""

    def __init__(self, error: RequestRefused) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(slots=True)
class _Exchange:
    """One ext_proc stream's state: the request as it arrives, then its dispatch."""

    full_duplex: bool = False
    response_phase: bool = False  # whether Envoy sends the answer's headers and body
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: frozenset[str] | None = None
    lifecycle: RequestLifecycle | None = None
    routed: RoutedRequest | None = None
    endpoints: dict[str, str] = field(default_factory=dict)  # address -> worker id, ranked
    dispatch: Dispatch | None = None
    answered: bool = False  # where the request goes is said
    status: int = 200
    streamed_answer: StreamUsage = field(default_factory=StreamUsage)
    whole_answer: bytearray = field(default_factory=bytearray)  # a non-streamed one

    @property
    def streamed(self) -> bool:
        """Whether the client asked for its answer streamed."""
        return self.routed is not None and self.routed.parsed.stream


class EndpointPicker:
    """`envoy.service.ext_proc.v3.ExternalProcessor` (added to a server by
    add_ExternalProcessorServicer_to_server, which needs only `Process`)."""

    def __init__(self, flow: RequestFlow) -> None:
        self.flow = flow

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        exchange = _Exchange()
        # Whatever ends the RPC (the picker's last word, Envoy's close or reset, the
        # router stopping), the request's end is accounted for once, after it.
        context.add_done_callback(
            functools.partial(self._end, exchange)  # type: ignore[arg-type]  # stubs: a class
        )
        async for message in request_iterator:
            try:
                async for answer in self._answer(exchange, message):
                    yield answer
            except _Refused as refused:
                yield refusal(refused.error)
                return
            if exchange.answered and not exchange.response_phase:
                # The picker's part is done: ending the stream lets Envoy go on without
                # it (a BUFFERED stream would stay open to the answer's end), so that a
                # picker that stops now hurts no request in progress.
                return

    async def _answer(
        self, exchange: _Exchange, message: ProcessingRequest
    ) -> AsyncIterator[ProcessingResponse]:
        hint = subset_hint(message)
        if hint is not None:
            exchange.subset = hint
        if message.HasField("protocol_config"):
            config = message.protocol_config
            exchange.full_duplex = config.request_body_mode == _FULL_DUPLEX
            exchange.response_phase = config.response_body_mode != _NO_BODY
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            async for answer in self._on_headers(exchange, message):
                yield answer
        elif kind == "request_body":
            async for answer in self._on_body(exchange, message):
                yield answer
        elif kind == "request_trailers":
            if not exchange.answered:  # the body ended on its trailers
                async for answer in self._routed(exchange):
                    yield answer
            yield ProcessingResponse(request_trailers=TrailersResponse())
        elif kind == "response_headers":
            yield self._on_response_headers(exchange, message)
        elif kind == "response_body":
            yield self._on_response_body(exchange, message)
        elif kind == "response_trailers":
            yield ProcessingResponse(response_trailers=TrailersResponse())

    async def _on_headers(
        self, exchange: _Exchange, message: ProcessingRequest
    ) -> AsyncIterator[ProcessingResponse]:
        if exchange.lifecycle is not None:  # Envoy sends them once: a stream that lies
            raise _Refused(self.flow.refused(BadRequest("the request's headers came twice")))
        exchange.headers = request_headers(message.request_headers)
        try:
            headers = exchange.headers
            exchange.lifecycle = self.flow.admit(
                headers.get("authorization"),
                headers.get(PRIORITY_HEADER),
                headers.get(DEADLINE_HEADER),
            )
        except RequestRefused as refused:  # counted
            raise _Refused(refused) from None
        if message.request_headers.end_of_stream:
            yield destination_on_headers(self._any_endpoints(exchange))
            exchange.answered = True
        elif not exchange.full_duplex:
            yield go_on_with_headers()

    async def _on_body(
        self, exchange: _Exchange, message: ProcessingRequest
    ) -> AsyncIterator[ProcessingResponse]:
        if exchange.lifecycle is None:
            raise _Refused(self.flow.refused(BadRequest("a body came before the headers")))
        chunk = message.request_body
        exchange.body += chunk.body
        limit = self.flow.settings.max_body_bytes
        if len(exchange.body) > limit:
            error = BadRequest(f"the request body is larger than {limit} bytes", status=413)
            raise _Refused(self.flow.refused(error))
        if chunk.end_of_stream:
            async for answer in self._routed(exchange):
                yield answer

    async def _routed(self, exchange: _Exchange) -> AsyncIterator[ProcessingResponse]:
        """The whole request is in: route it and say where it goes."""
        lifecycle = exchange.lifecycle
        if lifecycle is None:  # trailers with no headers before them
            raise _Refused(self.flow.refused(BadRequest("trailers came before the headers")))
        body = bytes(exchange.body)
        endpoint = _ENDPOINTS.get(exchange.headers.get(":path", "").split("?", 1)[0])
        if endpoint is None:  # not a generation: no prompt to route on
            addresses = self._any_endpoints(exchange)
        else:
            addresses, body = await self._decided(exchange, lifecycle, endpoint, body)
        # With flow control on, the router places requests: an engine in priority mode
        # must not be told otherwise by the client (vLLM reads this header first).
        remove = (ENGINE_PRIORITY_HEADER,) if self.flow.gate is not None else ()
        if exchange.full_duplex:
            # No Content-Length: Envoy drops it in this mode and sends the body chunked.
            yield destination_on_headers(addresses, remove)
            for answer in streamed_body(body):
                yield answer
        else:
            yield destination_on_body(addresses, body, remove)
        exchange.answered = True

    async def _decided(
        self, exchange: _Exchange, lifecycle: RequestLifecycle, endpoint: Endpoint, body: bytes
    ) -> tuple[list[str], bytes]:
        """The generation routed and dispatched: the endpoints, best first, and the body
        for them."""
        try:
            with lifecycle.traced(endpoint) as span:
                # Envoy moves one request to one endpoint: never split (docs/picker.md).
                routed = await lifecycle.route(body, endpoint, span, splits=False)
        except RequestRefused as refused:  # counted
            raise _Refused(refused) from None
        exchange.routed = routed
        for worker_id in routed.worker_ids(self.flow.settings.max_attempts):
            address = endpoint_of(routed.decision.info(worker_id).base_url)
            if _allowed(address, exchange.subset):
                exchange.endpoints[address] = worker_id
        if not exchange.endpoints:
            raise _Refused(self.flow.refused(self._none_in_subset()))
        addresses = list(exchange.endpoints)
        exchange.dispatch = lifecycle.dispatch(routed, exchange.endpoints[addresses[0]])
        # Envoy may send it to any of them: a priority only where all take one.
        return addresses, routed.engine_body(routed.body, list(exchange.endpoints.values()))

    def _any_endpoints(self, exchange: _Exchange) -> list[str]:
        """For a request with no prompt (a GET, a path that is no generation): the live
        workers with the fewest requests in flight first."""
        pool = self.flow.pool
        candidates = sorted(
            pool.candidates(), key=lambda candidate: pool.traffic(candidate.worker_id).in_flight
        )
        addresses = [endpoint_of(candidate.info.base_url) for candidate in candidates]
        addresses = [address for address in addresses if _allowed(address, exchange.subset)]
        if not addresses:
            assert exchange.lifecycle is not None
            if exchange.subset is not None:
                raise _Refused(self.flow.refused(self._none_in_subset()))
            raise _Refused(self.flow.refused(self.flow.no_worker(exchange.lifecycle.tenant)))
        return addresses[: self.flow.settings.max_attempts]

    def _none_in_subset(self) -> RequestRefused:
        return unavailable(
            "no live worker in the gateway's subset can take the request",
            outcome="no_worker_in_subset",
            retry_after_s=self.flow.settings.retry_after_s,
        )

    def _on_response_headers(
        self, exchange: _Exchange, message: ProcessingRequest
    ) -> ProcessingResponse:
        headers = request_headers(message.response_headers)
        status = headers.get(":status", "200")
        exchange.status = int(status) if status.isdigit() else 502
        dispatch = exchange.dispatch
        if dispatch is not None and not dispatch.ended:
            served = _served(message)
            worker_id = exchange.endpoints.get(served) if served else None
            if worker_id is not None and worker_id != dispatch.worker_id:
                # Envoy went to a fallback: the choice got nothing, the fallback the request.
                dispatch.failed(f"Envoy served {served} instead", refused=False)
                assert exchange.lifecycle is not None
                assert exchange.routed is not None
                dispatch = exchange.dispatch = exchange.lifecycle.dispatch(
                    exchange.routed, worker_id
                )
            dispatch.first_byte()
            if message.response_headers.end_of_stream:
                self._settle(exchange)
        return ProcessingResponse(response_headers=HeadersResponse())

    def _on_response_body(
        self, exchange: _Exchange, message: ProcessingRequest
    ) -> ProcessingResponse:
        chunk = message.response_body
        if exchange.streamed:
            exchange.streamed_answer.feed(chunk.body)
            if exchange.dispatch is not None and self.flow.gate is not None:
                exchange.dispatch.streamed(chunk.body)
        elif len(exchange.whole_answer) + len(chunk.body) <= _WHOLE_ANSWER_BYTES:
            exchange.whole_answer += chunk.body
        if chunk.end_of_stream:
            self._settle(exchange)
        if exchange.full_duplex:  # the picker is in the byte path: every chunk goes back
            return ProcessingResponse(
                response_body=BodyResponse(
                    response=CommonResponse(
                        body_mutation=BodyMutation(
                            streamed_response=StreamedBodyResponse(
                                body=chunk.body, end_of_stream=chunk.end_of_stream
                            )
                        )
                    )
                )
            )
        return ProcessingResponse(response_body=BodyResponse())

    def _settle(self, exchange: _Exchange) -> None:
        dispatch = exchange.dispatch
        if dispatch is not None:
            outcome = "ok" if dispatch.attempt == 1 else "ok_after_failover"
            usage = (
                exchange.streamed_answer.usage()
                if exchange.streamed
                else response_usage(bytes(exchange.whole_answer))
            )
            dispatch.settle(outcome, usage, exchange.status)

    def _end(self, exchange: _Exchange, _: object) -> None:
        """The RPC is over: a dispatch not settled by the response phase is handed off.
        Envoy ends the stream right after the picker's last answer when it skips the
        response phase, and ends it the same way (a half-close, then a reset) whether the
        request finished or the client left: the end says nothing about the answer."""
        if exchange.dispatch is not None:
            exchange.dispatch.hand_off()
        if exchange.lifecycle is not None:
            exchange.lifecycle.close()


def _allowed(address: str, subset: frozenset[str] | None) -> bool:
    """Whether the gateway's subset hint (None: none given) lets `address` in: named as
    HOST:PORT, or by its host alone (llm-d matches on the IP)."""
    return subset is None or address in subset or address.rsplit(":", 1)[0] in subset


def _served(message: ProcessingRequest) -> str | None:
    namespace = message.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_KEY].string_value or None
