"""The simulator's HTTP API: OpenAI-compatible generation, health, metrics, test hooks.

- `POST /v1/completions`, `POST /v1/chat/completions` (stream or not), `GET /v1/models`,
  `GET /health`, `GET /metrics`, `GET /version`, `POST /reset_prefix_cache`: as vLLM
  serves them. A streamed chat answer's first chunk (the assistant role) goes out with
  the first token, after prefill, as vLLM sends it.
- `POST /v1/completions/render`, `POST /v1/chat/completions/render`: the token ids (and
  sampling parameters) the same request to the generation endpoint would run with, as
  vLLM 0.32 renders them; routers such as vllm-router tokenise through them. Like vLLM,
  only with `--enable-scale-out`; without it these and vLLM's other scale-out paths
  answer 403.
- `GET /sim/blocks`: the engine's true block set, each block tagged with its cache scope
  and tier (`?prefixes=1`: and every token up to its end): the device's in `blocks`, the
  CPU tier's (with offloading) in `host_blocks`; and hits on another scope's blocks, for
  tests that compare the router's index with the engines.
- `POST /sim/faults`: inject faults at run time (stall, drop event batches, restart, die,
  slow metrics, P/D faults).
- `POST /sim/kv/pull` (with a KV connector): a decode engine takes over a finished prefill
  leg's blocks (kv_transfer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from simulations.engine_sim import protocol
from simulations.engine_sim.block_hash import wire_hash
from simulations.engine_sim.block_pool import KVBlock
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.engine import EngineStopped, SimEngine
from simulations.engine_sim.kv_transfer import (
    PULL_PATH,
    KVLoadFailed,
    PullClient,
    PullRefused,
    PullRequest,
    RemotePrefill,
    asks_remote_decode,
    prefill_answer_params,
    remote_prefill,
    remote_prefill_cached_tokens,
)
from simulations.engine_sim.offload import CPUBlock
from simulations.engine_sim.protocol import ChatCompletionRequest, CompletionRequest
from simulations.engine_sim.request import SimRequest
from simulations.engine_sim.scheduler import RequestProgress, RequestTooLarge

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


# vLLM 0.32 registers these only with --enable-scale-out, and otherwise answers every
# one of them 403 before reading the body (vllm/entrypoints/scale_out/factories.py).
# The simulator implements the first two.
_SCALE_OUT_PATHS = (
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/completions/derender",
    "/v1/chat/completions/derender",
    "/inference/v1/generate",
)
_SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
_UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)

# vLLM 0.32 takes a request's priority from this header over the body's field
# (vllm/entrypoints/generate/base/serving.py).
_PRIORITY_HEADER = "x-vllm-priority"

GenerationRequest = CompletionRequest | ChatCompletionRequest


class RequestError(Exception):
    """A request the API refuses, with vLLM's status, error type and parameter."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        error_type: str = "BadRequestError",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param


@dataclass(frozen=True, slots=True)
class _Prompt:
    """One prompt's token ids, and whether they came from text the simulator tokenised
    (vLLM tokenises text only up to one token past the context, so it reports an
    over-long text prompt as "at least" that long)."""

    token_ids: list[int]
    from_text: bool


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stall_s: float | None = Field(None, ge=0, le=3600)
    drop_event_fraction: float | None = Field(None, ge=0, le=1)
    odd_events: bool | None = None  # events no agent can use, in every batch
    restart: bool = False
    die: bool = False
    # /metrics answers only after this long (0: at once again), as a scrape can when an
    # engine's server is busy; /health is not affected, and a restart keeps it.
    metrics_stall_s: float | None = Field(None, ge=0, le=3600)
    # P/D, with a KV connector. A prefill leg answers without kv_transfer_params and
    # lends nothing (finish reason "stop"), as vLLM does for an aborted leg, and as
    # releases before 0.34 did at an EOS stop (0.34 answers them at EOS too):
    pd_no_params: bool | None = None
    pd_fail_transfer: bool | None = None  # this engine refuses every pull
    # The lease of blocks lent from now on (0: they expire at once); null: the
    # configured --kv-lease-s again.
    pd_lease_s: float | None = Field(None, ge=0, le=3600)

    @property
    def touches_pd(self) -> bool:
        return bool({"pd_no_params", "pd_fail_transfer", "pd_lease_s"} & self.model_fields_set)


@dataclass(frozen=True, slots=True)
class _Admitted:
    """A validated generation request, ready for the engine."""

    request_id: str
    model: str
    lora_name: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None
    priority: int
    seed: int | None
    stream: bool
    include_usage: bool
    remote_decode: bool  # the prefill leg of a P/D pair
    remote_prefill: RemotePrefill | None  # the decode leg's blocks to pull
    remote_prefill_cached_tokens: int | None  # the prefill's hits, for the decode's usage


def die_now() -> None:
    """Fault: end the process at once, as a crash would (no clean-up, no goodbye)."""
    os.kill(os.getpid(), signal.SIGKILL)


def create_engine_app(
    engine: SimEngine,
    tokenizer: PromptTokenizer,
    config: EngineSimConfig,
    *,
    pull_client: PullClient | None = None,
    die: Callable[[], None] = die_now,
) -> Starlette:
    """The simulator's HTTP API; P/D (kv_transfer.py) is on when a `pull_client` is
    given, for the decode legs' pulls."""
    output_text = {
        token_id: tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size)
    }
    requests_seen = 0

    def prompts(parsed: GenerationRequest) -> list[_Prompt]:
        """The request's prompts as token ids, as vLLM's renderer tokenises them."""
        if isinstance(parsed, ChatCompletionRequest):
            return [_chat_prompt(parsed, tokenizer)]
        return [
            _Prompt(tokenizer.completion_tokens(prompt), from_text=isinstance(prompt, str))
            for prompt in _completion_prompts(parsed)
        ]

    def admit(body: Any, chat: bool, priority_header: str | None) -> _Admitted:
        parsed = _parse(body, chat)
        model, lora_name = _resolve_model(parsed.model, config)
        batch = prompts(parsed)
        if len(batch) > 1:
            raise RequestError("The simulator serves one prompt per request, not a batch.")
        tokens = batch[0].token_ids
        max_tokens = _output_budget(batch[0], *parsed.output_limit, config.max_model_len)
        _check_vocabulary(tokens, tokenizer.vocab_size)
        try:
            engine.scheduler.check_fits(len(tokens) + max_tokens)
        except RequestTooLarge as error:
            raise RequestError(str(error)) from None
        prefix = "chatcmpl" if chat else "cmpl"
        transfer_params = parsed.kv_transfer_params if pull_client is not None else None
        return _Admitted(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            model=model,
            lora_name=lora_name,
            prompt_token_ids=tokens,
            max_tokens=max_tokens,
            cache_salt=parsed.cache_salt,
            priority=_priority(parsed, priority_header),
            seed=parsed.seed,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            remote_decode=asks_remote_decode(transfer_params),
            remote_prefill=remote_prefill(transfer_params),
            # vLLM's output processor reads this with or without a connector.
            remote_prefill_cached_tokens=remote_prefill_cached_tokens(parsed.kv_transfer_params),
        )

    async def generation(request: Request, chat: bool) -> Response:
        nonlocal requests_seen
        if not engine.alive:
            return _error("the engine has failed", 503, "ServiceUnavailableError")
        try:
            admitted = admit(await _json_body(request), chat, request.headers.get(_PRIORITY_HEADER))
        except RequestError as error:
            return _request_error(error)
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
            priority=admitted.priority,
            remote_decode=admitted.remote_decode,
        )
        sim_request.remote_prefill_cached_tokens = admitted.remote_prefill_cached_tokens
        # A decode leg's pull, and its failure, happen in the engine (kv_transfer.py).
        progress = engine.generate(sim_request, admitted.remote_prefill, pull_client)
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
        except KVLoadFailed:
            return _json_response(_GENERATION_ERROR, 500)
        if output is None:
            return Response(status_code=499)  # nobody is listening
        text = "".join(output_text[token_id] for token_id in output)
        usage = protocol.usage_body(
            len(admitted.prompt_token_ids),
            len(output),
            sim_request.usage_cached_tokens,
            config.enable_prompt_tokens_details,
        )
        build = protocol.chat_body if chat else protocol.completion_body
        body = build(admitted.request_id, admitted.model, text, _finish_reason(sim_request), usage)
        if sim_request.lent_block_ids is not None:
            host, port = request.scope["server"]  # this socket: where the decode pulls from
            body["kv_transfer_params"] = prefill_answer_params(
                sim_request.lent_block_ids,
                engine.lender.engine_id,
                sim_request.request_id,
                sim_request.num_computed_tokens,
                host,
                port,
                # Finished with its first output: vLLM has its prefill statistics.
                (sim_request.num_cached_tokens or 0) if len(output) == 1 else None,
            )
        return _json_response(body)

    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    def render(body: Any, chat: bool, header_id: str | None) -> list[dict[str, Any]]:
        """vLLM's render: the same parsing, model check, tokenisation and output budget
        as generation, and no engine-side checks (vocabulary, cache size)."""
        parsed = _parse(body, chat)
        _resolve_model(parsed.model, config)
        batch = prompts(parsed)
        limit, param = parsed.output_limit
        budgets = [_output_budget(prompt, limit, param, config.max_model_len) for prompt in batch]
        ids = _render_ids(chat, header_id or parsed.request_id or _random_id(), len(batch))
        return [
            protocol.render_body(request_id, prompt.token_ids, parsed, budget)
            for request_id, prompt, budget in zip(ids, batch, budgets, strict=True)
        ]

    async def completions_render(request: Request) -> Response:
        try:
            rendered = render(await _json_body(request), False, _header_request_id(request))
        except RequestError as error:
            return _request_error(error)
        return _json_response(rendered)  # a list: one entry per prompt of a batch

    async def chat_completions_render(request: Request) -> Response:
        try:
            rendered = render(await _json_body(request), True, _header_request_id(request))
        except RequestError as error:
            return _request_error(error)
        return _json_response(rendered[0])

    async def scale_out_disabled(request: Request) -> Response:
        return _error(_SCALE_OUT_DISABLED, 403, "PermissionDeniedError")

    async def models(request: Request) -> Response:
        body = protocol.models_body(
            config.model_names, config.model, config.lora_names, config.max_model_len
        )
        return _json_response(body)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if engine.alive else 503)

    async def version(request: Request) -> Response:
        return _json_response({"version": protocol.VLLM_VERSION})

    metrics_stall_s = 0.0

    async def metrics(request: Request) -> Response:
        if metrics_stall_s:
            await asyncio.sleep(metrics_stall_s)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(request: Request) -> Response:
        if not engine.reset_prefix_cache():
            return _error("requests still hold KV blocks; try again when idle", 409, "Conflict")
        await engine.publish_events()
        return Response(status_code=200)

    async def blocks(request: Request) -> Response:
        with_prefixes = request.query_params.get("prefixes") == "1"

        def entry(block: KVBlock | CPUBlock, digest: bytes, **fields: Any) -> dict[str, Any]:
            listed = {"hash": wire_hash(digest), "scope": block.scope, **fields}
            if with_prefixes and block.lineage is not None:
                listed["prefix_token_ids"] = block.lineage.prefix_token_ids()
            return listed

        cached = [
            entry(block, block.digest, ref_cnt=block.ref_cnt, tier="device")
            for block in engine.pool.cached_blocks()
            if block.digest is not None
        ]
        tier = None if engine.offload is None else engine.offload.tier
        host = [] if tier is None else tier.stored_blocks()
        return _json_response(
            {
                "block_size": config.block_size,
                "num_blocks": config.num_blocks,
                "num_free_blocks": engine.pool.num_free_blocks,
                "num_host_blocks": 0 if tier is None else tier.num_blocks,
                "cross_scope_hits": engine.kv_cache.stats.cross_scope_hits,
                "blocks": cached,
                "host_blocks": [entry(block, block.digest, tier="host") for block in host],
            }
        )

    async def kv_pull(request: Request) -> Response:
        try:
            pull = PullRequest.model_validate(await _json_body(request))
        except RequestError as error:
            return _error(str(error))
        except ValidationError as error:
            return _error(protocol.validation_message(error))
        try:
            engine.lender.hand_over(pull.remote_request_id, pull.remote_engine_id, pull.num_blocks)
        except PullRefused as refusal:
            return _error(str(refusal), refusal.status, refusal.error_type)
        return _json_response({"num_blocks": pull.num_blocks})

    async def faults(request: Request) -> Response:
        nonlocal metrics_stall_s
        try:
            fault = FaultRequest.model_validate(await _json_body(request))
        except RequestError as error:
            return _error(str(error))
        except ValidationError as error:
            return _error(protocol.validation_message(error))
        if fault.touches_pd and pull_client is None:
            return _error("P/D is off: no NixlConnector in --kv-transfer-config", 409, "Conflict")
        if fault.die:
            die()
        if fault.stall_s is not None:
            engine.stall(fault.stall_s)
        if fault.drop_event_fraction is not None:
            if engine.publisher is None:
                return _error("KV events are off: there are no batches to drop", 409, "Conflict")
            engine.publisher.drop_fraction = fault.drop_event_fraction
        if fault.odd_events is not None:
            if engine.publisher is None:
                return _error("KV events are off: there are no batches", 409, "Conflict")
            engine.publisher.odd_events = fault.odd_events
        if fault.restart:
            engine.restart()
        if fault.metrics_stall_s is not None:
            metrics_stall_s = fault.metrics_stall_s
        if fault.pd_no_params is not None:
            engine.lender.withhold = fault.pd_no_params
        if fault.pd_fail_transfer is not None:
            engine.lender.refuse_pulls = fault.pd_fail_transfer
        if "pd_lease_s" in fault.model_fields_set:
            engine.lender.lease_override_s = fault.pd_lease_s
        log.warning("fault injected: %s", fault.model_dump(exclude_defaults=True))
        return _json_response({"ok": True})

    if config.enable_scale_out:
        scale_out = [
            Route("/v1/completions/render", completions_render, methods=["POST"]),
            Route("/v1/chat/completions/render", chat_completions_render, methods=["POST"]),
        ]
    else:
        scale_out = [Route(path, scale_out_disabled, methods=["POST"]) for path in _SCALE_OUT_PATHS]
    transfers = [] if pull_client is None else [Route(PULL_PATH, kv_pull, methods=["POST"])]
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            *scale_out,
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/sim/blocks", blocks, methods=["GET"]),
            Route("/sim/faults", faults, methods=["POST"]),
            *transfers,
        ]
    )


def _parse(body: Any, chat: bool) -> GenerationRequest:
    model_type = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model_type.model_validate(body)
    except ValidationError as error:
        raise RequestError(protocol.validation_message(error)) from None


def _resolve_model(requested: str | None, config: EngineSimConfig) -> tuple[str, str | None]:
    """The model name to report and the LoRA adapter (if any) a request asks for."""
    if not requested:  # vLLM serves a request that names no model (or "") the first one
        return config.model_names[0], None
    if requested in config.model_names:
        return requested, None
    if requested in config.lora_names:
        return requested, requested
    raise RequestError(
        f"The model `{requested}` does not exist. Valid aliases: {', '.join(config.model_names)}.",
        404,
        "NotFoundError",
        param="model",
    )


def _completion_prompts(parsed: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request (a batch is a list of them), with vLLM 0.32's
    errors for a missing or empty one."""
    prompt = parsed.prompt
    if prompt is None or prompt == "":
        raise RequestError(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            param="prompt",
        )
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("You must pass at least one prompt")
    # The request model admits only homogeneous lists: ids, strings, or lists of ids.
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _chat_prompt(parsed: ChatCompletionRequest, tokenizer: PromptTokenizer) -> _Prompt:
    if parsed.chat_template is not None:
        raise RequestError(_UNTRUSTED_TEMPLATE)
    if not parsed.messages:
        raise RequestError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    try:
        tokens = tokenizer.chat_tokens(
            [message.as_template_input() for message in parsed.messages],
            add_generation_prompt=parsed.add_generation_prompt,
            template_kwargs=parsed.chat_template_kwargs,
        )
    except ValueError as error:
        raise RequestError(str(error)) from None
    return _Prompt(tokens, from_text=True)


def _output_budget(prompt: _Prompt, requested: int | None, param: str, limit: int) -> int:
    """vLLM 0.32's length rules; returns the number of tokens to generate.

    An output limit past the context is refused, and so is a prompt longer than the
    context; otherwise the output is capped to what the context leaves (older vLLM
    refused a prompt plus output past the context), and must come to at least one token.
    """
    if requested is not None and requested > limit:
        raise RequestError(
            f"{param}={requested} cannot be greater than max_model_len={limit}. Please "
            f"request fewer output tokens. (parameter={param}, value={requested})",
            param=param,
        )
    count = len(prompt.token_ids)
    if prompt.from_text:
        count = min(count, limit + 1)
    if count > limit:
        at_least = "at least " if count == limit + 1 else ""
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {at_least}{count} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={count})",
            param="input_tokens",
        )
    budget = limit - count if requested is None else min(requested, limit - count)
    if budget < 1:
        raise RequestError(
            f"max_tokens must be at least 1, got {budget}. (parameter=max_tokens, value={budget})",
            param="max_tokens",
        )
    return budget


def _check_vocabulary(tokens: list[int], vocab_size: int) -> None:
    # The engine's check, so generation makes it and render does not.
    if not tokens:
        raise RequestError("The prompt cannot be empty.")
    if any(token >= vocab_size for token in tokens):
        raise RequestError(f"Token id out of vocabulary (vocabulary size {vocab_size}).")


def _priority(parsed: GenerationRequest, header: str | None) -> int:
    """vLLM 0.32's `_get_priority`: the header's value if it reads as an integer, else
    the body's. Neither is refused without --scheduling-policy priority: vLLM 0.32
    checks neither against the policy, and its FCFS queue never reads them."""
    if header is not None:
        with contextlib.suppress(ValueError):
            return int(header)
    return parsed.priority


def _header_request_id(request: Request) -> str | None:
    return request.headers.get("x-request-id")


def _random_id() -> str:
    # vLLM's random_uuid(): 64 random bits as 16 hex digits.
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def _render_ids(chat: bool, base: str, count: int) -> list[str]:
    """Request ids of a rendered batch: vLLM numbers them only when there are several."""
    prefix = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
    return [prefix] if count == 1 else [f"{prefix}-{index}" for index in range(count)]


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
                cached = step.request.usage_cached_tokens
                text = output_text[step.new_token_id]
                finish = _finish_reason(step.request) if step.finished else None
                if chat:
                    yield _event(protocol.chat_chunk(request_id, model, {"content": text}, finish))
                else:
                    yield _event(protocol.completion_chunk(request_id, model, text, finish))
        except EngineStopped as error:
            yield _event(protocol.error_body(str(error), 500, "InternalServerError"))
        except KVLoadFailed:
            for event in _kv_load_failed_events(admitted, chat):
                yield event
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


def _finish_reason(request: SimRequest) -> str:
    # Every output is length-capped, except a prefill leg whose parameters a fault
    # withholds: that models a release before vLLM 0.34 stopping at EOS.
    return "stop" if request.remote_decode and request.lent_block_ids is None else "length"


# What vLLM 0.34 answers for a request its engine finished with an error, such as a KV
# load that failed under kv_load_failure_policy "fail": GenerationError's message
# (vllm/exceptions.py), as an InternalServerError (its serve/exception_handling).
_GENERATION_ERROR = protocol.error_body("Internal server error", 500, "InternalServerError")


def _kv_load_failed_events(admitted: _Admitted, chat: bool) -> list[bytes]:
    """vLLM's streamed answer to a request whose KV load failed under the "fail" policy
    (the status is 200, sent before the failure; unstreamed: HTTP 500 with the
    generation error): (chat) the role chunk, which vLLM sends with the engine's first
    output, here the error, then the error event (`data: [DONE]` follows). Chat
    serialises the error compactly (pydantic), completions with `json.dumps`' spacing,
    as vLLM's two stream generators do."""
    if not chat:
        return [b"data: " + json.dumps(_GENERATION_ERROR).encode() + b"\n\n"]
    role = {"role": "assistant", "content": ""}
    return [
        _event(protocol.chat_chunk(admitted.request_id, admitted.model, role, None)),
        _event(_GENERATION_ERROR),
    ]


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


def _json_response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400, error_type: str = "BadRequestError") -> Response:
    return _json_response(protocol.error_body(message, status, error_type), status)


def _request_error(error: RequestError) -> Response:
    body = protocol.error_body(str(error), error.status, error.error_type, error.param)
    return _json_response(body, error.status)
