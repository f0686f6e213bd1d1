"""The simulator's HTTP API: OpenAI-compatible generation, health, metrics, test hooks.

- `POST /v1/completions`, `POST /v1/chat/completions` (stream or not), `GET /v1/models`,
  `GET /health`, `GET /metrics`, `POST /reset_prefix_cache`: as vLLM serves them. A
  streamed chat answer's first chunk (the assistant role) goes out with the first token,
  after prefill, as vLLM sends it.
- `GET /sim/blocks`: the engine's true block set, each block tagged with its cache scope
  (`?prefixes=1`: and every token up to its end), and hits on another scope's blocks,
  for tests that compare the router's index with the engines.
- `POST /sim/faults`: inject faults at run time (stall, drop event batches, restart, die).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvplane.core.tokenizer import PromptTokenizer
from simulations.engine import protocol
from simulations.engine.block_hash import wire_hash
from simulations.engine.config import EngineSimConfig
from simulations.engine.engine import EngineStopped, SimEngine
from simulations.engine.protocol import ChatCompletionRequest, CompletionRequest
from simulations.engine.request import SimRequest
from simulations.engine.scheduler import RequestProgress, RequestTooLarge

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


class RequestError(Exception):
    """A request the API refuses, with vLLM's status and error type."""

    def __init__(self, message: str, status: int = 400, error_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.error_type = error_type


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stall_s: float | None = Field(None, ge=0, le=3600)
    drop_event_fraction: float | None = Field(None, ge=0, le=1)
    restart: bool = False
    die: bool = False


@dataclass(frozen=True, slots=True)
class _Admitted:
    """A validated generation request, ready for the engine."""

    request_id: str
    model: str
    lora_name: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None
    seed: int | None
    stream: bool
    include_usage: bool


def die_now() -> None:
    """Fault: end the process at once, as a crash would (no clean-up, no goodbye)."""
    os.kill(os.getpid(), signal.SIGKILL)


def create_engine_app(
    engine: SimEngine,
    tokenizer: PromptTokenizer,
    config: EngineSimConfig,
    *,
    die: Callable[[], None] = die_now,
) -> Starlette:
    output_text = {
        token_id: tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size)
    }
    requests_seen = 0

    def admit(body: Any, chat: bool) -> _Admitted:
        model_type = ChatCompletionRequest if chat else CompletionRequest
        try:
            parsed: ChatCompletionRequest | CompletionRequest = model_type.model_validate(body)
        except ValidationError as error:
            raise RequestError(protocol.validation_message(error)) from None
        model, lora_name = _resolve_model(parsed.model, config)
        try:
            if isinstance(parsed, ChatCompletionRequest):
                tokens = tokenizer.chat_tokens(
                    [message.as_template_input() for message in parsed.messages],
                    add_generation_prompt=parsed.add_generation_prompt,
                    template_kwargs=parsed.chat_template_kwargs,
                )
                wanted = parsed.requested_max_tokens
            else:
                tokens = tokenizer.completion_tokens(parsed.single_prompt())
                wanted = parsed.max_tokens
        except ValueError as error:
            raise RequestError(str(error)) from None
        max_tokens = _check_lengths(tokens, wanted, tokenizer.vocab_size, config)
        try:
            engine.scheduler.check_fits(len(tokens) + max_tokens)
        except RequestTooLarge as error:
            raise RequestError(str(error)) from None
        prefix = "chatcmpl" if chat else "cmpl"
        return _Admitted(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            model=model,
            lora_name=lora_name,
            prompt_token_ids=tokens,
            max_tokens=max_tokens,
            cache_salt=parsed.cache_salt,
            seed=parsed.seed,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
        )

    async def generation(request: Request, chat: bool) -> Response:
        nonlocal requests_seen
        if not engine.alive:
            return _error("the engine has failed", 503, "ServiceUnavailableError")
        try:
            admitted = admit(await _json_body(request), chat)
        except RequestError as error:
            return _error(str(error), error.status, error.error_type)
        requests_seen += 1
        if config.fail_after_requests is not None and requests_seen > config.fail_after_requests:
            log.warning("fault: dying on request %d as configured", requests_seen)
            die()
        sim_request = engine.new_request(
            admitted.request_id,
            admitted.prompt_token_ids,
            admitted.max_tokens,
            lora_name=admitted.lora_name,
            cache_salt=admitted.cache_salt,
            sampling_seed=_sampling_seed(admitted, config.seed),
        )
        progress = engine.generate(sim_request)
        if admitted.stream:
            return StreamingResponse(
                _sse(admitted, progress, chat, output_text, config),
                media_type="text/event-stream",
            )
        collected = asyncio.create_task(_collect(progress))
        try:
            output = await _unless_disconnected(request, collected)
        except EngineStopped as error:
            return _error(str(error), 500, "InternalServerError")
        if output is None:
            return Response(status_code=499)  # nobody is listening
        text = "".join(output_text[token_id] for token_id in output)
        usage = protocol.usage_body(
            len(admitted.prompt_token_ids),
            len(output),
            sim_request.num_cached_tokens or 0,
            config.enable_prompt_tokens_details,
        )
        build = protocol.chat_body if chat else protocol.completion_body
        return _json_response(build(admitted.request_id, admitted.model, text, "length", usage))

    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    async def models(request: Request) -> Response:
        body = protocol.models_body(
            config.model_names, config.model, config.lora_names, config.max_model_len
        )
        return _json_response(body)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if engine.alive else 503)

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(request: Request) -> Response:
        if not engine.reset_prefix_cache():
            return _error("requests still hold KV blocks; try again when idle", 409, "Conflict")
        await engine.publish_events()
        return Response(status_code=200)

    async def blocks(request: Request) -> Response:
        with_prefixes = request.query_params.get("prefixes") == "1"
        cached = []
        for block in engine.pool.cached_blocks():
            if block.digest is None:
                continue
            entry: dict[str, Any] = {
                "hash": wire_hash(block.digest),
                "scope": block.scope,
                "ref_cnt": block.ref_cnt,
            }
            if with_prefixes and block.lineage is not None:
                entry["prefix_token_ids"] = block.lineage.prefix_token_ids()
            cached.append(entry)
        return _json_response(
            {
                "block_size": config.block_size,
                "num_blocks": config.num_blocks,
                "num_free_blocks": engine.pool.num_free_blocks,
                "cross_scope_hits": engine.kv_cache.stats.cross_scope_hits,
                "blocks": cached,
            }
        )

    async def faults(request: Request) -> Response:
        try:
            fault = FaultRequest.model_validate(await _json_body(request))
        except RequestError as error:
            return _error(str(error))
        except ValidationError as error:
            return _error(protocol.validation_message(error))
        if fault.die:
            die()
        if fault.stall_s is not None:
            engine.stall(fault.stall_s)
        if fault.drop_event_fraction is not None:
            if engine.publisher is None:
                return _error("KV events are off: there are no batches to drop", 409, "Conflict")
            engine.publisher.drop_fraction = fault.drop_event_fraction
        if fault.restart:
            engine.restart()
        log.warning("fault injected: %s", fault.model_dump(exclude_defaults=True))
        return _json_response({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/sim/blocks", blocks, methods=["GET"]),
            Route("/sim/faults", faults, methods=["POST"]),
        ]
    )


def _resolve_model(requested: str | None, config: EngineSimConfig) -> tuple[str, str | None]:
    """The model name to report and the LoRA adapter (if any) a request asks for."""
    if requested is None or requested in config.model_names:
        return config.model_names[0] if requested is None else requested, None
    if requested in config.lora_names:
        return requested, requested
    raise RequestError(f"The model `{requested}` does not exist.", 404, "NotFoundError")


def _check_lengths(
    tokens: list[int], max_tokens: int | None, vocab_size: int, config: EngineSimConfig
) -> int:
    """vLLM's length checks; returns the number of tokens to generate."""
    count, limit = len(tokens), config.max_model_len
    if not tokens:
        raise RequestError("The prompt cannot be empty.")
    if any(token < 0 or token >= vocab_size for token in tokens):
        raise RequestError(f"Token id out of vocabulary (vocabulary size {vocab_size}).")
    if count >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {count} input tokens. Please reduce the length of the input messages."
        )
    if max_tokens is None:
        max_tokens = limit - count
    elif count + max_tokens > limit:
        raise RequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {limit} tokens and your request has {count} "
            f"input tokens ({max_tokens} > {limit} - {count})."
        )
    return max_tokens


def _sampling_seed(admitted: _Admitted, engine_seed: int) -> int:
    # The same prompt gives the same output unless the client asks for a seed.
    if admitted.seed is not None:
        return admitted.seed
    return hash((engine_seed, tuple(admitted.prompt_token_ids)))


async def _json_body(request: Request) -> Any:
    # msgspec rather than json: it refuses lone surrogates and invalid UTF-8 (which would
    # break tokenisation and event encoding later) and out-of-range numbers.
    try:
        return msgspec.json.decode(await request.body())
    except msgspec.DecodeError as error:
        raise RequestError(f"JSON decode error: {error}") from None
    except RecursionError:
        raise RequestError("JSON decode error: nested too deeply") from None


async def _collect(progress: AsyncGenerator[RequestProgress[SimRequest], None]) -> list[int]:
    async with contextlib.aclosing(progress):  # closing it aborts the request if unfinished
        return [step.new_token_id async for step in progress]


async def _unless_disconnected(request: Request, work: asyncio.Task[list[int]]) -> list[int] | None:
    """The work's result, or None (the work cancelled) if the client goes away first."""
    disconnected = asyncio.create_task(_disconnect(request))
    try:
        await asyncio.wait({work, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(
    admitted: _Admitted,
    progress: AsyncGenerator[RequestProgress[SimRequest], None],
    chat: bool,
    output_text: dict[int, str],
    config: EngineSimConfig,
) -> AsyncIterator[bytes]:
    request_id, model = admitted.request_id, admitted.model
    sent = 0
    cached = 0
    async with contextlib.aclosing(progress):  # closing it aborts the request if unfinished
        try:
            async for step in progress:
                if chat and not sent:
                    # vLLM sends the role with the engine's first output, that is after
                    # prefill: a client's time to first chunk is its time to first token.
                    role = {"role": "assistant", "content": ""}
                    yield _event(protocol.chat_chunk(request_id, model, role, None))
                sent += 1
                cached = step.request.num_cached_tokens or 0
                text = output_text[step.new_token_id]
                finish = "length" if step.finished else None
                if chat:
                    yield _event(protocol.chat_chunk(request_id, model, {"content": text}, finish))
                else:
                    yield _event(protocol.completion_chunk(request_id, model, text, finish))
        except EngineStopped as error:
            yield _event(protocol.error_body(str(error), 500, "InternalServerError"))
        else:
            if admitted.include_usage:
                usage = protocol.usage_body(
                    len(admitted.prompt_token_ids),
                    sent,
                    cached,
                    config.enable_prompt_tokens_details,
                )
                yield _event(protocol.usage_chunk(request_id, model, chat, usage))
    yield b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


def _json_response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400, error_type: str = "BadRequestError") -> Response:
    return _json_response(protocol.error_body(message, status, error_type), status)
