"""vLLM's render endpoints over real HTTP: the token ids a request would run with, the
sampling parameters vLLM would build, vLLM 0.32's errors, and the 403 without
--enable-scale-out."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvplane.core.tokenizer import load_tokenizer
from tests.simulations.engine_sim.conftest import engine_sim

PROMPT = "You are a helpful assistant. Answer the question below in one short paragraph. " * 4
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]},
]
COMPLETIONS_RENDER = "/v1/completions/render"
CHAT_RENDER = "/v1/chat/completions/render"
BLOCK = 16


async def post(client: httpx.AsyncClient, path: str, body: Any) -> Any:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def cached_prefixes(client: httpx.AsyncClient) -> list[list[int]]:
    """Every token up to the end of each block the engine holds, shortest first."""
    blocks = (await client.get("/sim/blocks", params={"prefixes": "1"})).json()["blocks"]
    return sorted((block["prefix_token_ids"] for block in blocks), key=len)


def assert_cached_exactly(prefixes: list[list[int]], token_ids: list[int]) -> None:
    """The engine's full prompt blocks hold these token ids, block for block."""
    prompt_blocks = [prefix for prefix in prefixes if len(prefix) <= len(token_ids)]
    assert [len(prefix) for prefix in prompt_blocks] == [
        BLOCK * n for n in range(1, len(token_ids) // BLOCK + 1)
    ]
    for prefix in prompt_blocks:
        assert prefix == token_ids[: len(prefix)]


async def test_completion_render_gives_the_ids_the_engine_then_caches() -> None:
    async with (
        engine_sim(enable_scale_out=True) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        [rendered] = await post(client, COMPLETIONS_RENDER, {"prompt": PROMPT, "max_tokens": 2})
        assert await cached_prefixes(client) == []  # rendering runs nothing
        await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        prefixes = await cached_prefixes(client)
    expected = load_tokenizer().completion_tokens(PROMPT)
    assert rendered["token_ids"] == expected
    assert len(expected) > 3 * BLOCK
    assert_cached_exactly(prefixes, rendered["token_ids"])
    assert rendered["request_id"].startswith("cmpl-")
    assert len(rendered["request_id"]) == len("cmpl-") + 16  # vLLM's 64-bit hex ids
    assert rendered["model"] is None  # echoed as the request gave it
    assert rendered["sampling_params"] == {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
        "max_tokens": 2,
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    # Every field of vLLM's GenerateRequest, in its order.
    assert list(rendered) == [
        "request_id",
        "token_ids",
        "token_offsets",
        "features",
        "content_parts",
        "sampling_params",
        "model",
        "reasoning_ended",
        "reasoning_parser_kwargs",
        "return_token_ids",
        "output_mode",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
        "ec_transfer_params",
    ]


async def test_chat_render_uses_the_chat_template_as_generation_does() -> None:
    body = {"model": "kvplane-tiny", "messages": MESSAGES, "cache_salt": "tenant-a"}
    async with (
        engine_sim(enable_scale_out=True, max_model_len=512) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        rendered = await post(client, CHAT_RENDER, body)
        answer = await post(client, "/v1/chat/completions", {**body, "max_tokens": 1})
        prefixes = await cached_prefixes(client)
    template_input = [MESSAGES[0], {"role": "user", "content": "What is the capital?"}]
    expected = load_tokenizer().chat_tokens(template_input)
    assert isinstance(rendered, dict)  # chat renders one request, not a list
    assert rendered["token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)
    assert_cached_exactly(prefixes, expected)
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["model"] == "kvplane-tiny"
    assert rendered["cache_salt"] == "tenant-a"
    # No output limit: what the context leaves, as vLLM computes it.
    assert rendered["sampling_params"]["max_tokens"] == 512 - len(expected)


async def test_render_writes_the_sampling_parameters_vllm_would_build() -> None:
    body = {
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 3,
        "seed": 7,
        "stop": "STOP",
        "stop_token_ids": [3, 3, 4],
        "ignore_eos": True,
        "max_completion_tokens": 16,
        "min_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
        "priority": -1,
    }
    async with (
        engine_sim(enable_scale_out=True) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        rendered = await post(client, CHAT_RENDER, body)
    # Greedy sampling drops top_p, top_k and min_p; 16 tokens is the default, left out.
    assert rendered["sampling_params"] == {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 0,
        "seed": 7,
        "stop": ["STOP"],
        "stop_token_ids": [3, 4],
        "ignore_eos": True,
        "min_tokens": 2,
        "logprobs": 2,
        "output_kind": 1,
        "skip_clone": True,
        "output_text_buffer_length": 3,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    assert rendered["stream"] is True
    assert rendered["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert rendered["priority"] == -1


async def test_a_batch_renders_one_request_per_prompt() -> None:
    tokenizer = load_tokenizer()
    async with (
        engine_sim(enable_scale_out=True) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        batch = await post(client, COMPLETIONS_RENDER, {"prompt": ["a b", "c d"]})
        named = await post(client, COMPLETIONS_RENDER, {"prompt": [[1, 2], [3]], "request_id": "r"})
        from_header = await client.post(
            COMPLETIONS_RENDER, json={"prompt": [1, 2, 3]}, headers={"X-Request-Id": "h1"}
        )
    assert [item["token_ids"] for item in batch] == [
        tokenizer.completion_tokens("a b"),
        tokenizer.completion_tokens("c d"),
    ]
    base = batch[0]["request_id"].removesuffix("-0")
    assert [item["request_id"] for item in batch] == [f"{base}-0", f"{base}-1"]
    assert [item["token_ids"] for item in named] == [[1, 2], [3]]  # ids are taken as given
    assert [item["request_id"] for item in named] == ["cmpl-r-0", "cmpl-r-1"]
    assert from_header.json()[0]["request_id"] == "cmpl-h1"


async def test_the_output_limit_is_capped_to_the_context_as_vllm_032_does() -> None:
    async with (
        engine_sim(enable_scale_out=True, max_model_len=256) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        [rendered] = await post(client, COMPLETIONS_RENDER, {"prompt": [5] * 250, "max_tokens": 9})
        answer = await post(client, "/v1/completions", {"prompt": [5] * 250, "max_tokens": 9})
    assert rendered["sampling_params"]["max_tokens"] == 6
    assert answer["usage"]["completion_tokens"] == 6


RENDER_ERRORS = [
    pytest.param(
        COMPLETIONS_RENDER,
        {"model": "nope", "prompt": "x"},
        404,
        "NotFoundError",
        "model",
        "The model `nope` does not exist. Valid aliases: kvplane-tiny.",
        id="unknown-model",
    ),
    pytest.param(
        COMPLETIONS_RENDER,
        {"prompt": ""},
        400,
        "BadRequestError",
        "prompt",
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        id="empty-prompt",
    ),
    pytest.param(
        COMPLETIONS_RENDER,
        {"prompt": []},
        400,
        "BadRequestError",
        None,
        "You must pass at least one prompt",
        id="no-prompts",
    ),
    pytest.param(
        COMPLETIONS_RENDER,
        {"prompt": "word " * 300},
        400,
        "BadRequestError",
        "input_tokens",
        "This model's maximum context length is 256 tokens. However, your prompt contains "
        "at least 257 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=257)",
        id="text-past-the-context",
    ),
    pytest.param(
        COMPLETIONS_RENDER,
        {"prompt": [5] * 300},
        400,
        "BadRequestError",
        "input_tokens",
        "This model's maximum context length is 256 tokens. However, your prompt contains "
        "300 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=300)",
        id="ids-past-the-context",
    ),
    pytest.param(
        COMPLETIONS_RENDER,
        {"prompt": [5] * 256},
        400,
        "BadRequestError",
        "max_tokens",
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        id="no-room-to-generate",
    ),
    pytest.param(
        CHAT_RENDER,
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300},
        400,
        "BadRequestError",
        "max_completion_tokens",
        "max_completion_tokens=300 cannot be greater than max_model_len=256. Please request "
        "fewer output tokens. (parameter=max_completion_tokens, value=300)",
        id="output-past-the-context",
    ),
    pytest.param(
        CHAT_RENDER,
        {"messages": []},
        400,
        "BadRequestError",
        None,
        "Cannot apply chat template to an empty conversation. Provide at least one message.",
        id="no-messages",
    ),
    pytest.param(
        CHAT_RENDER,
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7 * 7 }}"},
        400,
        "BadRequestError",
        None,
        "Chat template is passed with request, but --trust-request-chat-template is not "
        "set. Refused request with untrusted chat template.",
        id="request-template",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "kind", "param", "message"), RENDER_ERRORS)
async def test_bad_render_requests_get_vllm_032s_errors(
    path: str, body: Any, status: int, kind: str, param: str | None, message: str
) -> None:
    async with (
        engine_sim(enable_scale_out=True, max_model_len=256) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        response = await client.post(path, json=body)
    assert response.status_code == status
    assert response.json() == {
        "error": {"message": message, "type": kind, "param": param, "code": status}
    }


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"prompt": "x"', id="invalid-json"),
        pytest.param(b'{"prompt": "x", "temperature": "hot"}', id="wrong-type"),
        pytest.param(b'{"prompt": [1, -2]}', id="negative-token-id"),
        pytest.param(b"[1, 2]", id="not-an-object"),
    ],
)
async def test_malformed_render_requests_are_400s(body: bytes) -> None:
    async with (
        engine_sim(enable_scale_out=True) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        response = await client.post(
            COMPLETIONS_RENDER, content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400


async def test_render_does_not_check_the_vocabulary_but_generation_does() -> None:
    # vLLM's render is frontend work; the engine refuses unknown ids when it runs them.
    body = {"prompt": [1, 2, 99999], "max_tokens": 1}
    async with (
        engine_sim(enable_scale_out=True) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        [rendered] = await post(client, COMPLETIONS_RENDER, body)
        generated = await client.post("/v1/completions", json=body)
    assert rendered["token_ids"] == [1, 2, 99999]
    assert generated.status_code == 400


@pytest.mark.parametrize(
    "path",
    [COMPLETIONS_RENDER, CHAT_RENDER, "/v1/completions/derender", "/inference/v1/generate"],
)
async def test_without_scale_out_the_scale_out_paths_are_403_as_in_vllm(path: str) -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        response = await client.post(path, json={"prompt": "x"})
        version = await client.get("/version")
    assert response.status_code == 403
    assert response.json() == {
        "error": {
            "message": "Scale-out endpoints are disabled. Restart vllm serve with "
            "--enable-scale-out to enable them.",
            "type": "PermissionDeniedError",
            "param": None,
            "code": 403,
        }
    }
    assert version.json() == {"version": "0.32.0"}
