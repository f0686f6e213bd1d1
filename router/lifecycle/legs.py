"""The bodies of a disaggregated request's two legs, and what the prefill leg's answer
hands on, in vLLM's NixlConnector protocol (vLLM's toy proxy, vllm-router's P/D mode):

- prefill leg: the client's body with `kv_transfer_params` asking for a remote decode,
  not streamed, one token (`max_tokens`, and `max_completion_tokens` where the client
  set it), without `stream_options` and the minimum lengths;
- decode leg: the client's body (its streaming and lengths) with the prefill answer's
  `kv_transfer_params`, verbatim;
- both legs under one `X-Request-Id`.

Parse and build only: the proxy moves the bytes.
"""

from __future__ import annotations

import enum
import uuid
from typing import Any

import msgspec

from router.lifecycle.bodies import ParsedRequest

REQUEST_ID_HEADER = "x-request-id"


class Leg(enum.Enum):
    """What a dispatch asks of its worker."""

    WHOLE = "whole"  # the request, computed where it goes
    PREFILL = "prefill"  # a split request's prompt, its KV handed on
    DECODE = "decode"  # a split request's answer, with the prompt's KV pulled


_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_NOT_FOR_ONE_TOKEN = ("stream_options", "min_tokens", "min_completion_tokens")
_decoder = msgspec.json.Decoder()


def leg_request_id() -> str:
    """The id both legs carry (the engines match the transfer's two ends by it)."""
    return f"kvplane-{uuid.uuid4().hex}"


def prefill_leg_body(parsed: ParsedRequest, cache_salt: str | None) -> bytes:
    body = {key: value for key, value in parsed.body.items() if key not in _NOT_FOR_ONE_TOKEN}
    body.update(kv_transfer_params=_REMOTE_DECODE, stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return msgspec.json.encode(body)


def decode_leg_body(parsed: ParsedRequest, cache_salt: str | None, params: Any) -> bytes:
    body = dict(parsed.body, kv_transfer_params=params)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return msgspec.json.encode(body)


class MissingParams(Exception):
    """A prefill answer that hands nothing on: the decode worker must compute the
    prompt itself. The message says why, without any of the answer's text."""


def handed_on_params(answer: bytes) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill leg's answer, as the decode leg must get
    them; MissingParams where the answer has none (vLLM returns none for an aborted
    request) or they cannot be for a remote prefill."""
    try:
        document = _decoder.decode(answer)
    except msgspec.DecodeError:
        raise MissingParams("the prefill answer is not JSON") from None
    params = document.get("kv_transfer_params") if isinstance(document, dict) else None
    if params is None:
        raise MissingParams("the prefill answer has no kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise MissingParams("the prefill answer's kv_transfer_params are not for a remote prefill")
    if not isinstance(params.get("remote_engine_id"), str) or not isinstance(
        params.get("remote_block_ids"), list
    ):
        raise MissingParams("the prefill answer's kv_transfer_params name no engine or blocks")
    return params
