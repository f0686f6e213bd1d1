"""OpenAI request bodies: what the router reads from them and what it adds.

The router reads the model, whether to stream, and the prompt (to tokenise it as the
engine will); it adds the tenant's cache salt. Everything else goes to the engine as
the client sent it: the engine is the judge of the rest, and its errors reach the
client unchanged. Error messages here name fields, never their contents.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request

from kvplane.core.keys import MAX_TOKEN_ID
from kvplane.core.tokenizer import PromptTokenizer
from router.errors import RequestRefused, documented
from router.tenants import SHARED_SCOPE, Tenant


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class BadRequest(RequestRefused):
    """A body the router cannot route; the message is safe to show and to log."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        outcome: str = "bad_request",
    ) -> None:
        super().__init__(status, message, kind="BadRequestError", outcome=outcome)
        self.param = param


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    stream: bool
    body: dict[str, Any]

    @property
    def client_cache_salt(self) -> str | None:
        salt = self.body.get("cache_salt")
        return salt if isinstance(salt, str) else None

    @property
    def answer_limit(self) -> int:
        """The longest answer the client allows, in tokens (0: it set none, or not as a
        positive whole number: the engine refuses that)."""
        limit = self.body.get("max_completion_tokens")
        if limit is None:
            limit = self.body.get("max_tokens")
        return _positive_whole(limit) or 0

    @property
    def answers(self) -> int:
        """How many answers the client asks for, each up to `answer_limit` (its `n`; 1
        where it set none, or not as a positive whole number: the engine refuses that)."""
        return _positive_whole(self.body.get("n")) or 1

    @property
    def prompts(self) -> int:
        """How many prompts a completions batch sends (1 for one prompt, and for chat):
        each is answered, and routing reads only the first."""
        if self.endpoint is not Endpoint.COMPLETIONS:
            return 1
        return _batch_length(self.body.get("prompt"))


def _positive_whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_decoder = msgspec.json.Decoder()

BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: documented("not JSON, not an object, or a field the router reads is wrong"),
    413: documented("the body is over proxy.max_body_bytes"),
}
"""What read_body, decode_json and the checks of the fields refuse, for the document."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) past `limit` bytes before more is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body is larger than {limit} bytes", status=413)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is larger than {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    try:
        document = _decoder.decode(raw)
    # RecursionError: nesting too deep; UnicodeDecodeError: a string that is not UTF-8
    # (msgspec raises it, not a DecodeError).
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    # Counting brackets (in C) spares the measure for all but bodies that could nest deeply.
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and _nesting(raw) > MAX_NESTING:
        raise BadRequest(f"the request body nests deeper than {MAX_NESTING} levels")
    return document


MAX_NESTING = 100
"""The deepest JSON nesting the router accepts. msgspec's own limit is Python's recursion
limit less the decoder's stack depth, so whatever walks a body later from a deeper stack
(re-encoding it, hashing it for the token cache) failed on one a few levels under it."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def _nesting(raw: bytes) -> int:
    """How deeply the valid JSON `raw` nests: the running count of its brackets outside
    strings (walking the decoded body in Python would cost several times the decoding)."""
    steps = _BRACKET_STEP[np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)]
    return int(np.cumsum(steps[steps != 0], dtype=np.int32).max(initial=0))


def parse_body(raw: bytes, endpoint: Endpoint) -> ParsedRequest:
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean", "stream")
    if endpoint is Endpoint.COMPLETIONS and "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    if endpoint is Endpoint.CHAT and not isinstance(body.get("messages"), list):
        raise BadRequest("'messages' must be an array", "messages")
    if "kv_transfer_params" in body:
        # It tells an engine which peer to read KV from: the router's to set, never a
        # client's (docs/pd-disaggregation.md).
        raise BadRequest("'kv_transfer_params' is set by the router", "kv_transfer_params")
    return ParsedRequest(endpoint, model, bool(stream), body)


@dataclass(frozen=True, slots=True)
class PromptText:
    """A prompt as the text the tokenizer encodes, and whether the tokenizer adds its
    special tokens (a completions prompt: yes; rendered messages: no, the chat template
    wrote them)."""

    text: str
    add_special_tokens: bool

    def whole_tokens(self, tokenizer: PromptTokenizer) -> list[int]:
        """The text tokenised whole, as the engine does."""
        return tokenizer.encode(self.text, add_special_tokens=self.add_special_tokens)


def prompt_input(
    request: ParsedRequest, tokenizer: PromptTokenizer
) -> PromptText | list[int] | None:
    """What the engine tokenises: the prompt's text (the messages rendered by the chat
    template), or the token ids a completions prompt gives; None when the router cannot
    tell (a shape it does not tokenise, a template that fails): the request is then
    routed on load alone and the engine judges it."""
    body = request.body
    try:
        if request.endpoint is Endpoint.COMPLETIONS:
            prompt = _first_prompt(body["prompt"])
            if isinstance(prompt, str):
                return PromptText(prompt, add_special_tokens=True)
            return None if prompt is None else list(prompt)
        template_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, Mapping):
            return None
        if body.get("tools"):
            template_kwargs = {**template_kwargs, "tools": body["tools"]}
        text = tokenizer.render_chat(
            [_flatten_text_parts(message) for message in body["messages"]],
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            template_kwargs=template_kwargs,
        )
        return PromptText(text, add_special_tokens=False)
    except (ValueError, TypeError, KeyError):
        return None


def _flatten_text_parts(message: Any) -> Any:
    """A message whose content is a list of text parts, as the engine renders it for a
    template that expects a string: the texts joined by newlines (vLLM's "string"
    content format). Other parts (images) are left for the template to refuse."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if not isinstance(content, list) or not all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _batch_length(prompt: Any) -> int:
    """A batch is a list of prompts, each text or token ids; one list of token ids is
    one prompt."""
    if not isinstance(prompt, list) or not prompt or type(prompt[0]) is int:
        return 1
    return len(prompt)


def _first_prompt(prompt: Any) -> str | Sequence[int] | None:
    """A batch routes on its first prompt (they go to one engine together)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(type(token) is int and 0 <= token <= MAX_TOKEN_ID for token in prompt):
            return prompt
        return _first_prompt(prompt[0]) if isinstance(prompt[0], str | list) else None
    return None


def key_scope(tenant: Tenant, parsed: ParsedRequest) -> str:
    """The cache scope the request's blocks are keyed in: the tenant's salt; in the
    shared scope, a salt the client chose itself (the engine isolates by it too)."""
    if tenant.cache_salt is not None:
        return tenant.cache_salt
    if tenant.cache_scope == SHARED_SCOPE:
        return parsed.client_cache_salt or ""
    return ""


def body_for_engine(raw: bytes, request: ParsedRequest, cache_salt: str | None) -> bytes:
    """The body to send upstream: as received, or with the tenant's cache salt set."""
    if cache_salt is None or request.body.get("cache_salt") == cache_salt:
        return raw
    return msgspec.json.encode({**request.body, "cache_salt": cache_salt})


ENGINE_PRIORITY_HEADER = "x-vllm-priority"  # vLLM takes it over the body's `priority`


def with_engine_priority(body: bytes, priority: int) -> bytes:
    """`body` (one the router built or checked) with vLLM's `priority` set."""
    return msgspec.json.encode({**_decoder.decode(body), "priority": priority})


def without_client_priority(raw: bytes, request: ParsedRequest) -> bytes:
    """The client's body without a `priority` of its own (`request.body` loses it too):
    with flow control on, the router places requests, and an engine in priority mode
    must not be told otherwise by the client."""
    if "priority" not in request.body:
        return raw
    del request.body["priority"]
    return msgspec.json.encode(request.body)


@dataclass(frozen=True, slots=True)
class Usage:
    """What a response's `usage` says about the prompt: its cache hits and its length."""

    cached_tokens: int | None  # None: no prompt_tokens_details (vLLM leaves it out at 0)
    prompt_tokens: int | None = None  # the engine's count; None: it sent none
    completion_tokens: int | None = None  # what it generated; None: it did not say


def response_usage(body: bytes) -> Usage | None:
    """The usage of a completion body; None when it has none."""
    try:
        document = _decoder.decode(body)
    except msgspec.DecodeError:
        return None
    return _usage(document)


def _usage(document: Any) -> Usage | None:
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        _count(cached), _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    )


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


class StreamUsage:
    """Finds the usage chunk of a server-sent event stream (sent last, before [DONE],
    when the client asked for `stream_options.include_usage`) without parsing every
    chunk: only the stream's tail is kept and read at the end."""

    _TAIL_BYTES = 16384

    def __init__(self) -> None:
        # The stream's last chunks, at least _TAIL_BYTES of them once there are: cut
        # back only past twice that, so that a chunk costs no copy of the whole tail.
        self._chunks: list[bytes] = []
        self._kept = 0

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._kept += len(chunk)
        if self._kept > 2 * self._TAIL_BYTES:
            tail = self._tail()
            self._chunks, self._kept = [tail], len(tail)

    def _tail(self) -> bytes:
        return b"".join(self._chunks)[-self._TAIL_BYTES :]

    def usage(self) -> Usage | None:
        for event in reversed(self._tail().split(b"\n\n")):
            data = event.strip()
            if data.startswith(b"data:") and b'"usage"' in data:
                try:
                    usage = _usage(_decoder.decode(data[5:].strip()))
                except msgspec.DecodeError:
                    return None
                if usage is not None:
                    return usage
        return None
