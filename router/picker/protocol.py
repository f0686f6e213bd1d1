"""The Gateway API Inference Extension's endpoint-picker protocol over Envoy's ext_proc
messages: what the picker reads from Envoy's and what it writes in its answers. Parsing
and building only; the decisions are the request lifecycle's (router/lifecycle).

The answer to a routed request: the header `x-gateway-destination-endpoint` and the same
value in the dynamic metadata `envoy.lb` (a comma list: the endpoints in order, the
first the choice and the rest fallbacks). Gateways read the header; Envoy drops the
metadata unless `metadata_options` lets `envoy.lb` in. Refusals go back as an
ImmediateResponse with the OpenAI-shaped body the embedded proxy sends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from router.errors import ErrorBody, ErrorDetail, RequestRefused

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"  # the dynamic metadata Envoy's load balancer reads
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
BODY_CHUNK_BYTES = 62_000
"""The most body bytes in one streamed body message back to Envoy (llm-d's cut: under the
64 KiB Envoy buffers per message)."""

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def request_headers(message: HttpHeaders) -> dict[str, str]:
    """The request's headers, names lower-cased (Envoy sends `raw_value` bytes; older
    Envoys `value`). A repeated header keeps its last value."""
    return {
        header.key.lower(): header.raw_value.decode("utf-8", "replace")
        if header.raw_value
        else header.value
        for header in message.headers.headers
    }


def subset_hint(message: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows (IP:PORT), if it said: a list or a comma list
    in `envoy.lb.subset_hint`; None when the message carries no hint."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        items = [item.string_value for item in value.list_value.values]
    else:
        items = value.string_value.split(",")
    return frozenset(item.strip() for item in items if item.strip())


def endpoint_of(base_url: str) -> str:
    """A worker's address as the gateway names endpoints: HOST:PORT."""
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _destination_mutation(
    endpoints: Sequence[str], content_length: int | None = None, remove: Sequence[str] = ()
) -> tuple[HeaderMutation, Struct]:
    value = ",".join(endpoints)
    set_headers = [
        HeaderValueOption(
            header=HeaderValue(key=DESTINATION_HEADER, raw_value=value.encode()),
            append_action=_OVERWRITE,
        )
    ]
    if content_length is not None:
        set_headers.append(
            HeaderValueOption(
                header=HeaderValue(key="content-length", raw_value=str(content_length).encode()),
                append_action=_OVERWRITE,
            )
        )
    metadata = Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: value}})
    return HeaderMutation(set_headers=set_headers, remove_headers=list(remove)), metadata


def destination_on_headers(
    endpoints: Sequence[str], remove: Sequence[str] = ()
) -> ProcessingResponse:
    """The answer to the request's headers: where it goes, less the headers `remove`
    names (FULL_DUPLEX_STREAMED: sent once the whole body is in, before the body;
    header-only requests)."""
    mutation, metadata = _destination_mutation(endpoints, remove=remove)
    return ProcessingResponse(
        request_headers=HeadersResponse(
            response=CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def destination_on_body(
    endpoints: Sequence[str], body: bytes, remove: Sequence[str] = ()
) -> ProcessingResponse:
    """The answer to a BUFFERED body: where it goes, and the body to send there, less
    the headers `remove` names."""
    mutation, metadata = _destination_mutation(endpoints, len(body), remove)
    return ProcessingResponse(
        request_body=BodyResponse(
            response=CommonResponse(
                header_mutation=mutation,
                body_mutation=BodyMutation(body=body),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=metadata,
    )


def go_on_with_headers() -> ProcessingResponse:
    """The headers unchanged (BUFFERED: Envoy then sends the body)."""
    return ProcessingResponse(request_headers=HeadersResponse())


def streamed_body(body: bytes) -> Iterator[ProcessingResponse]:
    """The body back to Envoy in FULL_DUPLEX_STREAMED mode, in chunks, the last one
    ending the stream (an empty body is one empty, ending chunk)."""
    for start in range(0, max(len(body), 1), BODY_CHUNK_BYTES):
        chunk = body[start : start + BODY_CHUNK_BYTES]
        last = start + BODY_CHUNK_BYTES >= len(body)
        yield ProcessingResponse(
            request_body=BodyResponse(
                response=CommonResponse(
                    body_mutation=BodyMutation(
                        streamed_response=StreamedBodyResponse(body=chunk, end_of_stream=last)
                    )
                )
            )
        )


def refusal(error: RequestRefused) -> ProcessingResponse:
    """A refusal as Envoy answers it to the client: the status, the OpenAI-shaped body
    the embedded proxy sends, its headers (Retry-After, WWW-Authenticate)."""
    body = ErrorBody(
        error=ErrorDetail(message=str(error), type=error.kind, param=None, code=error.status)
    )
    headers = {"content-type": "application/json", **(error.headers or {})}
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=error.status),
            headers=HeaderMutation(
                set_headers=[
                    HeaderValueOption(
                        header=HeaderValue(key=name, raw_value=value.encode()),
                        append_action=_OVERWRITE,
                    )
                    for name, value in headers.items()
                ]
            ),
            body=body.model_dump_json().encode(),
            details=f"kvplane_{error.outcome}",
        )
    )
