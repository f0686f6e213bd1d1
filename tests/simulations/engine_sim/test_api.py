"""The OpenAI-compatible API over real HTTP: answers, usage, caching, timing, errors."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from kvplane.core.tokenizer import load_tokenizer
from simulations.engine_sim.timing import StepWork, TimingModel, step_seconds
from tests.simulations.engine_sim.conftest import engine_sim
from tests.waiting import wait_until

PROMPT = "You are a helpful assistant. Answer the question below in one short paragraph. " * 4


def cached_tokens(body: dict[str, Any]) -> int:
    details = body["usage"]["prompt_tokens_details"]
    return 0 if details is None else int(details["cached_tokens"])


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/completions", json={"max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def first_token_seconds(client: httpx.AsyncClient, **body: Any) -> float:
    start = time.perf_counter()
    request = client.build_request(
        "POST", "/v1/completions", json={"max_tokens": 2, "stream": True, **body}
    )
    response = await client.send(request, stream=True)
    try:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    finally:
        await response.aclose()
    raise AssertionError("no token streamed")


async def test_a_repeated_prompt_reports_cached_tokens_and_is_deterministic() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        first = await complete(client, prompt=PROMPT)
        second = await complete(client, prompt=PROMPT)
    prompt_tokens = len(load_tokenizer().completion_tokens(PROMPT))
    assert first["usage"]["prompt_tokens"] == prompt_tokens
    assert first["usage"]["completion_tokens"] == 4
    assert cached_tokens(first) == 0
    # Every full block but the one holding the last prompt token comes from the cache.
    assert cached_tokens(second) == (prompt_tokens - 1) // 16 * 16
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["finish_reason"] == "length"


async def test_cached_prefixes_shorten_time_to_first_token() -> None:
    # A slow modelled prefill (2 ms per uncached token) makes the difference large.
    async with (
        engine_sim(time_scale=1.0, prefill_ms_per_token=2.0) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        cold = await first_token_seconds(client, prompt=PROMPT)
        warm = await first_token_seconds(client, prompt=PROMPT)
        other = await first_token_seconds(client, prompt=PROMPT, cache_salt="tenant-b")
    # About 0.08 tokens' worth against about 150: the cached prefill is far shorter.
    assert warm < cold / 2
    assert other > cold / 2  # another tenant's salt finds nothing cached


async def test_chat_requests_use_the_chat_template() -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]},
    ]
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        response = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    template_input = [
        messages[0],
        {"role": "user", "content": "What is the capital?"},
    ]
    expected = load_tokenizer().chat_tokens(template_input)
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("chat", [False, True])
async def test_streams_are_server_sent_events_ending_in_done(chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        response = await client.post(path, json=body)
        whole = await client.post(path, json={**body, "stream": False})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 5
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        assert text == whole.json()["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert text == whole.json()["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_a_streamed_chat_sends_its_first_chunk_only_after_prefill() -> None:
    # A slow modelled prefill (2 ms per uncached token, plus the fixed 10 ms).
    timing = TimingModel(prefill_ms_per_token=2.0, prefill_overhead_ms=10.0)
    messages = [{"role": "user", "content": PROMPT}]
    prompt_tokens = len(load_tokenizer().chat_tokens(messages))
    prefill_s = step_seconds(timing, StepWork(prefill_tokens=prompt_tokens))
    body = {"messages": messages, "max_tokens": 2, "stream": True}
    async with (
        engine_sim(
            time_scale=1.0,
            prefill_ms_per_token=timing.prefill_ms_per_token,
            prefill_overhead_ms=timing.prefill_overhead_ms,
        ) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        start = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            arrivals = [
                (time.perf_counter() - start, json.loads(line[len("data: ") :]))
                async for line in response.aiter_lines()
                if line.startswith("data: {")
            ]
    assert prefill_s > 0.2  # long enough that an early chunk could not pass unnoticed
    first_s, first = arrivals[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first_s >= prefill_s
    # The role comes with the first token, not a step before it.
    assert "content" in arrivals[1][1]["choices"][0]["delta"]
    assert arrivals[1][0] - first_s < prefill_s / 10


async def test_models_health_and_lora_adapters() -> None:
    async with (
        engine_sim(served_model_name=["tiny", "tiny-alias"], lora_modules=["sql=/x"]) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == ["tiny", "tiny-alias", "sql"]
        assert models["data"][2]["parent"] == "tiny"
        plain = await complete(client, model="tiny", prompt=PROMPT)
        adapted = await complete(client, model="sql", prompt=PROMPT)
        again = await complete(client, model="sql", prompt=PROMPT)
        assert plain["model"] == "tiny"
        assert adapted["model"] == "sql"
        assert cached_tokens(adapted) == 0  # the adapter's blocks are its own
        assert cached_tokens(again) > 0
        scopes = {block["scope"] for block in (await client.get("/sim/blocks")).json()["blocks"]}
        assert scopes == {"/", "sql/"}


async def test_salted_requests_never_share_blocks_with_unsalted_ones() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        await complete(client, prompt=PROMPT)
        salted = await complete(client, prompt=PROMPT, cache_salt="tenant-a")
        other_salt = await complete(client, prompt=PROMPT, cache_salt="tenant-b")
        salted_again = await complete(client, prompt=PROMPT, cache_salt="tenant-a")
        plain_again = await complete(client, prompt=PROMPT)
        blocks = (await client.get("/sim/blocks")).json()["blocks"]
    assert cached_tokens(salted) == cached_tokens(other_salt) == 0
    assert cached_tokens(salted_again) > 0
    assert cached_tokens(plain_again) == cached_tokens(salted_again)
    by_scope: dict[str, set[int]] = {}
    for block in blocks:
        by_scope.setdefault(block["scope"], set()).add(block["hash"])
    assert set(by_scope) == {"/", "/tenant-a", "/tenant-b"}
    assert not by_scope["/"] & by_scope["/tenant-a"]
    assert not by_scope["/tenant-a"] & by_scope["/tenant-b"]


BAD_REQUESTS = [
    pytest.param(b'{"prompt": "x", "max_tokens": 4', "JSON decode error", id="invalid-json"),
    pytest.param({"prompt": "x", "max_tokens": "many"}, "max_tokens", id="wrong-type"),
    pytest.param({"prompt": "x", "max_tokens": 0}, "max_tokens", id="zero-tokens"),
    pytest.param({"max_tokens": 4}, "prompt", id="no-prompt"),
    pytest.param({"prompt": "x", "cache_salt": ""}, "cache_salt", id="empty-salt"),
    pytest.param({"prompt": "x", "cache_salt": 7}, "cache_salt", id="salt-not-a-string"),
    pytest.param({"prompt": "x", "cache_salt": "a/b"}, "cache_salt", id="salt-with-slash"),
    pytest.param({"prompt": "x", "cache_salt": "s" * 129}, "cache_salt", id="salt-too-long"),
    pytest.param({"prompt": "word " * 300}, "maximum context length", id="prompt-too-long"),
    pytest.param(
        {"prompt": "x", "max_tokens": 300},
        "max_tokens=300 cannot be greater than max_model_len=256",
        id="output-past-the-context",
    ),
    pytest.param({"prompt": [1, 2, 99999]}, "vocabulary", id="token-out-of-range"),
    pytest.param({"prompt": []}, "at least one prompt", id="no-prompts"),
    pytest.param({"prompt": ""}, "non-empty", id="empty-prompt"),
    pytest.param({"prompt": [5] * 256}, "at least 1, got 0", id="prompt-fills-the-context"),
    pytest.param({"prompt": "x", "temperature": "hot"}, "temperature", id="bad-sampling"),
    pytest.param({"prompt": "x", "top_p": 0}, "top_p", id="top-p-zero"),
    pytest.param(b'{"prompt": "x\\ud800"}', "JSON decode error", id="lone-surrogate"),
    pytest.param(
        b'{"prompt": "x", "cache_salt": "\\udc00"}', "JSON decode error", id="surrogate-salt"
    ),
    pytest.param(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "JSON", id="huge-int"),
    pytest.param(b"[" * 100_000, "JSON decode error", id="deeply-nested"),
    pytest.param(b"\xff\xfe", "JSON decode error", id="not-utf8"),
]


@pytest.mark.parametrize(("body", "expected"), BAD_REQUESTS)
async def test_bad_requests_get_vllm_style_400s_that_do_not_echo_the_prompt(
    body: Any, expected: str
) -> None:
    async with (
        engine_sim(max_model_len=256) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        if isinstance(body, bytes):
            response = await client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
        else:
            response = await client.post("/v1/completions", json=body)
        error = response.json()["error"]
        assert response.status_code == 400
        assert error["code"] == 400
        assert expected in error["message"]
        assert "word word" not in error["message"]
        # Nothing was scheduled and nothing cached.
        assert (await client.get("/sim/blocks")).json()["blocks"] == []


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"chat_template": "{{ 7 * 7 }}"}, id="request-template"),
        pytest.param({"chat_template_kwargs": {"chat_template": "x"}}, id="template-in-kwargs"),
        pytest.param({"messages": []}, id="no-messages"),
    ],
)
async def test_chat_requests_cannot_bring_their_own_template(extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400


async def test_unknown_models_are_404_and_unknown_fields_are_ignored() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        missing = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        extra = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": 3, "foo": [1]}
        )
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"
    assert extra.status_code == 200


async def test_a_cache_too_small_for_the_request_is_a_clear_error() -> None:
    async with (
        engine_sim(num_gpu_blocks_override=2, block_size=16) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        response = await client.post("/v1/completions", json={"prompt": PROMPT})
    assert response.status_code == 400
    assert "KV blocks" in response.json()["error"]["message"]


async def test_metrics_have_vllm_names_and_count_hits_and_preemptions() -> None:
    # A tiny cache and concurrent long generations force preemptions.
    async with (
        engine_sim(num_gpu_blocks_override=12, block_size=16) as sim,
        httpx.AsyncClient(base_url=sim.base_url, timeout=30) as client,
    ):
        prompts = [f"{index} {PROMPT[:60]}" for index in range(6)]
        results = await asyncio.gather(
            *(complete(client, prompt=prompt, max_tokens=40) for prompt in prompts)
        )
        assert all(r["usage"]["completion_tokens"] == 40 for r in results)
        await complete(client, prompt=prompts[0])
        text = (await client.get("/metrics")).text
    samples = metric_samples(text)
    labels = '{engine="0",model_name="kvplane-tiny"}'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert name + labels in samples
    assert samples["vllm:num_preemptions_total" + labels] > 0
    assert samples["vllm:prefix_cache_hits_total" + labels] > 0
    assert (
        samples["vllm:prefix_cache_queries_total" + labels]
        > samples["vllm:prefix_cache_hits_total" + labels]
    )
    assert samples["vllm:num_requests_running" + labels] == 0
    info = [key for key in samples if key.startswith("vllm:cache_config_info{")]
    assert len(info) == 1
    assert 'block_size="16"' in info[0]
    assert 'num_gpu_blocks="12"' in info[0]


def metric_samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def test_a_client_that_disconnects_frees_its_request() -> None:
    body = {"prompt": PROMPT, "max_tokens": 500}
    async with (
        engine_sim(time_scale=1.0, decode_step_ms=50.0) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        scheduler = sim.engine.scheduler
        request = client.build_request("POST", "/v1/completions", json={**body, "stream": True})
        response = await client.send(request, stream=True)
        await wait_until("the streamed request runs", lambda: bool(scheduler.running))
        await response.aclose()
        await wait_until("the streamed request is aborted", lambda: not scheduler.has_work)

        waiting = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_until("the request runs", lambda: bool(scheduler.running))
        waiting.cancel()  # closes the connection under the unanswered request
        await wait_until("the request is aborted", lambda: not scheduler.has_work)
        assert sim.engine.pool.num_free_blocks == sim.engine.config.num_blocks
