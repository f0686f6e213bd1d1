"""The OpenAI-compatible API's request models, errors and response bodies, as vLLM's.

Unknown fields are accepted and ignored (vLLM does the same, so clients that send
sampling options the simulator does not model still work); known fields of the wrong
type are a 400. Error messages never repeat the request's content.

The render bodies (`render_body`) are what vLLM 0.32's `/v1/completions/render` and
`/v1/chat/completions/render` return: its `GenerateRequest`
(vllm/entrypoints/scale_out/token_in_token_out/protocol.py) with the `SamplingParams`
the generation endpoint would have built, serialised as vLLM serialises it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# The vLLM release whose API the simulator follows (GET /version reports it).
VLLM_VERSION = "0.32.0"
_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams.max_tokens
CACHE_SALT_MAX_CHARS = 128
_CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(_OpenAIModel):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="the simulator generates one choice")
    cache_salt: str | None = None
    # Sampling options are checked as vLLM checks them, then ignored: the simulator's
    # output is seeded noise of the requested length.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    user: str | None = None
    # Lower is served first with --scheduling-policy priority; ignored otherwise, as
    # vLLM 0.32 ignores it (its description promises an error that no code raises).
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = None  # the render endpoints' ids build on it, as vLLM's do
    # P/D legs (kv_transfer.py); read only when the engine has a KV connector, as in vLLM.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        if salt is None:
            return None
        if not salt:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        if len(salt) > CACHE_SALT_MAX_CHARS:
            raise ValueError(
                f"Parameter 'cache_salt' must be at most {CACHE_SALT_MAX_CHARS} characters."
            )
        if any(char in salt for char in _CACHE_SALT_FORBIDDEN):
            raise ValueError("Parameter 'cache_salt' must not contain '@', '/', '\\' or NUL.")
        return salt

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(_GenerationRequest):
    # Optional and unchecked here: vLLM words a missing or empty prompt its own way
    # (server.py), not as a validation error.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    # Not bounded below: vLLM reports max_tokens < 1 as "must be at least 1, got N".
    max_tokens: int | None = _DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)

    @field_validator("max_tokens")
    @classmethod
    def _null_means_the_default(cls, max_tokens: int | None) -> int:
        # vLLM 0.32 generates 16 tokens for `"max_tokens": null`, as when it is absent.
        return _DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens

    @property
    def output_limit(self) -> tuple[int | None, str]:
        """The requested number of output tokens and the parameter that asked for it."""
        return self.max_tokens, "max_tokens"

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(_OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(_OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content if part.type == "text")
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @property
    def output_limit(self) -> tuple[int | None, str]:
        """The requested number of output tokens and the parameter that asked for it
        (vLLM prefers max_completion_tokens and names it in its errors)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- errors -------------------------------------------------------------------------


def error_body(
    message: str, status: int, error_type: str = "BadRequestError", param: str | None = None
) -> dict[str, Any]:
    """vLLM's error shape (since 0.10.1)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def validation_message(error: ValidationError) -> str:
    """A pydantic error as text, without the offending input (it may be prompt text)."""
    problems = []
    for problem in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in problem["loc"])
        problems.append(f"{where}: {problem['msg']}" if where else problem["msg"])
    count = len(problems)
    return f"{count} validation error{'s' if count != 1 else ''}: " + "; ".join(problems)


# -- response bodies ----------------------------------------------------------------


def usage_body(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, report_cached: bool
) -> dict[str, Any]:
    details = {"cached_tokens": cached_tokens} if report_cached and cached_tokens else None
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }


def _envelope(
    request_id: str, kind: str, model: str, choice: dict[str, Any] | None, **extra: Any
) -> dict[str, Any]:
    """The fields every response and chunk has; `choice` is the one choice, if any."""
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [] if choice is None else [{"index": 0, **choice, "logprobs": None}],
        **extra,
    }


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    choice = {
        "text": text,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    return _envelope(request_id, "text_completion", model, choice, usage=usage)


def completion_chunk(
    request_id: str, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    choice = {"text": text, "finish_reason": finish_reason, "stop_reason": None}
    return _envelope(request_id, "text_completion", model, choice)


def chat_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text, "tool_calls": []}
    choice = {"message": message, "finish_reason": finish_reason, "stop_reason": None}
    return _envelope(request_id, "chat.completion", model, choice, usage=usage)


def chat_chunk(
    request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    choice = {"delta": delta, "finish_reason": finish_reason}
    return _envelope(request_id, "chat.completion.chunk", model, choice)


def usage_chunk(request_id: str, model: str, chat: bool, usage: dict[str, Any]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _envelope(request_id, kind, model, None, usage=usage)


def models_body(
    names: list[str], root: str, lora_names: list[str], max_model_len: int
) -> dict[str, Any]:
    created = int(time.time())

    def card(name: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root if parent is None else name,
            "parent": parent,
            "max_model_len": max_model_len,
        }

    return {
        "object": "list",
        "data": [card(name, None) for name in names]
        + [card(name, names[0]) for name in lora_names],
    }


# -- render bodies (vLLM 0.32, --enable-scale-out) ------------------------------------

# vLLM's SamplingParams constants: a lower temperature means greedy sampling (top_p,
# top_k and min_p are then reset), and a positive one below the floor is raised to it.
_GREEDY_BELOW = 1e-5
_TEMPERATURE_FLOOR = 1e-2
_OUTPUT_KIND_DELTA, _OUTPUT_KIND_FINAL_ONLY = 1, 2  # vLLM's RequestOutputKind


def render_body(
    request_id: str,
    token_ids: list[int],
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
) -> dict[str, Any]:
    """One rendered prompt: vLLM's GenerateRequest, every field present, in its order.

    The fields the simulator has nothing for (multimodal features, reasoning parser,
    token offsets, KV transfer) are null as they are for a text-only model.
    """
    stream_options = request.stream_options
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_params_body(request, max_tokens),
        "model": request.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": request.stream,
        # vLLM passes stream options on only for a streamed request.
        "stream_options": stream_options.model_dump()
        if request.stream and stream_options is not None
        else None,
        "cache_salt": request.cache_salt,
        "priority": request.priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def sampling_params_body(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> dict[str, Any]:
    """The SamplingParams vLLM builds for the request, as its render endpoints write it.

    vLLM serialises a msgspec struct with omit_defaults, which compares by identity: the
    penalties and the temperature (always set from the request or a dict of defaults,
    so never the class's own objects) are always written; top_p and min_p too unless
    greedy sampling reset them; small integers equal to their default are left out.
    Lists that SamplingParams fills in (stop, stop_token_ids, bad_words) are written.
    """
    temperature = 1.0 if request.temperature is None else request.temperature
    if 0 < temperature < _TEMPERATURE_FLOOR:
        temperature = _TEMPERATURE_FLOOR
    stop = _stop_strings(request.stop)
    body: dict[str, Any] = {
        "presence_penalty": _or_default(request.presence_penalty, 0.0),
        "frequency_penalty": _or_default(request.frequency_penalty, 0.0),
        "repetition_penalty": _or_default(request.repetition_penalty, 1.0),
        "temperature": temperature,
    }
    if temperature >= _GREEDY_BELOW:
        body["top_p"] = _or_default(request.top_p, 1.0)
        if request.top_k:
            body["top_k"] = request.top_k
        body["min_p"] = _or_default(request.min_p, 0.0)
    if request.seed is not None and request.seed != -1:  # -1 means no seed
        body["seed"] = request.seed
    body["stop"] = stop
    body["stop_token_ids"] = list(dict.fromkeys(request.stop_token_ids or []))
    if request.ignore_eos:
        body["ignore_eos"] = True
    if max_tokens != _DEFAULT_MAX_TOKENS:
        body["max_tokens"] = max_tokens
    if request.min_tokens:
        body["min_tokens"] = request.min_tokens
    if request.output_logprobs is not None:
        body["logprobs"] = request.output_logprobs
    body["output_kind"] = _OUTPUT_KIND_DELTA if request.stream else _OUTPUT_KIND_FINAL_ONLY
    body["skip_clone"] = True
    if stop:
        # Characters held back to evaluate stop strings, when there are any to hold.
        held_back = max(len(text) for text in stop) - 1
        if held_back:
            body["output_text_buffer_length"] = held_back
    body["bad_words"] = []
    body["skip_reading_prefix_cache"] = False
    return body


def _or_default(value: float | None, default: float) -> float:
    return default if value is None else value


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
