"""Envoy's side of an ext_proc stream, built here as Envoy builds its messages, for
tests that speak to a picker over real gRPC without Envoy."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import grpc.aio
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct

FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
BUFFERED = ProcessingMode.BodySendMode.BUFFERED


def headers_message(
    path: str = "/v1/completions",
    *,
    method: str = "POST",
    authorization: str | None = None,
    end_of_stream: bool = False,
    mode: int = FULL_DUPLEX,
    extra: dict[str, str] | None = None,
) -> ProcessingRequest:
    headers = {":path": path, ":method": method, ":authority": "gateway", **(extra or {})}
    if authorization is not None:
        headers["authorization"] = authorization
    return ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(
                headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            ),
            end_of_stream=end_of_stream,
        ),
        protocol_config=ProtocolConfiguration(request_body_mode=mode),
    )


def body_messages(
    body: bytes, *, chunks: int = 1, subset: Sequence[str] | str | None = None
) -> list[ProcessingRequest]:
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [
        ProcessingRequest(request_body=HttpBody(body=part, end_of_stream=i == len(parts) - 1))
        for i, part in enumerate(parts)
    ]
    if subset is not None:  # llm-d reads the hint on the body's last message
        hint = Struct()
        hint.update(
            {
                "x-gateway-destination-endpoint-subset": subset
                if isinstance(subset, str)
                else list(subset)
            }
        )
        messages[-1].metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return messages


class Exchange:
    """One ext_proc stream, driven message by message as Envoy does."""

    def __init__(self, opened: grpc.aio.Channel) -> None:
        self.call = ExternalProcessorStub(opened).Process()

    async def send(self, *messages: ProcessingRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def receive(self) -> ProcessingResponse:
        answer = await asyncio.wait_for(self.call.read(), 10)
        assert answer is not grpc.aio.EOF
        assert isinstance(answer, ProcessingResponse)
        return answer

    async def finish(self) -> None:
        """Envoy is done with the request: the stream closes cleanly."""
        await self.call.done_writing()
        assert await asyncio.wait_for(self.call.read(), 10) is grpc.aio.EOF


def destination(answer: ProcessingResponse, phase: str = "request_headers") -> list[str]:
    common = getattr(answer, phase).response
    (option,) = [
        h
        for h in common.header_mutation.set_headers
        if h.header.key == "x-gateway-destination-endpoint"
    ]
    value: str = option.header.raw_value.decode()
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert metadata.fields["x-gateway-destination-endpoint"].string_value == value
    assert option.append_action == option.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
    return value.split(",")


def set_header(answer: ProcessingResponse, name: str, phase: str = "request_headers") -> str | None:
    for option in getattr(answer, phase).response.header_mutation.set_headers:
        if option.header.key == name:
            return str(option.header.raw_value.decode())
    return None


async def streamed_back(exchange: Exchange) -> bytes:
    body: bytes = b""
    while True:
        answer = await exchange.receive()
        streamed = answer.request_body.response.body_mutation.streamed_response
        body += streamed.body
        if streamed.end_of_stream:
            return body
