"""The OpenAI-compatible API's request models, errors and response bodies, as vLLM's.

Unknown fields are accepted and ignored (vLLM does the same, so clients that send
sampling options the simulator does not model still work); known fields of the wrong
type are a 400. Error messages never repeat the request's content.
"""

from __future__ import annotations

import time
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CACHE_SALT_MAX_CHARS = 128
_CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_OpenAIModel):
    include_usage: bool = False


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


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (a batch of one is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("The prompt cannot be empty.")
        first = prompt[0]
        if isinstance(first, int):
            return cast(list[int], prompt)
        if len(prompt) > 1:
            raise ValueError("The simulator serves one prompt per request, not a batch.")
        return first


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
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("chat_template")
    @classmethod
    def _refuse_request_templates(cls, template: str | None) -> None:
        if template is not None:
            raise ValueError(
                "Chat template is passed with request, but --trust-request-chat-template "
                "is not set. Refused request with untrusted chat template."
            )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
