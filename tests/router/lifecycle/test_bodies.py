"""OpenAI request bodies: what the router reads, what it adds, and what it never echoes."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvplane.core.tokenizer import PromptTokenizer, load_tokenizer
from router.lifecycle.bodies import (
    BadRequest,
    Endpoint,
    ParsedRequest,
    PromptText,
    StreamUsage,
    Usage,
    body_for_engine,
    parse_body,
    prompt_input,
    response_usage,
)

SECRET_PROMPT = "zebra-quartz-7731 confidential"
BOS = 1  # <s> of the default tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return load_tokenizer()


def raw(**body: object) -> bytes:
    return json.dumps(body).encode()


def bad(data: bytes, endpoint: Endpoint = Endpoint.COMPLETIONS) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        parse_body(data, endpoint)
    assert SECRET_PROMPT not in str(caught.value)
    return caught.value


# -- parse_body --------------------------------------------------------------------------


def test_a_completions_body_is_parsed() -> None:
    parsed = parse_body(raw(model="m", prompt="hi", stream=True), Endpoint.COMPLETIONS)
    assert (parsed.endpoint, parsed.model, parsed.stream) == (Endpoint.COMPLETIONS, "m", True)
    assert parsed.body == {"model": "m", "prompt": "hi", "stream": True}
    assert parsed.client_cache_salt is None


def test_stream_defaults_to_false_and_accepts_null() -> None:
    assert not parse_body(raw(model="m", prompt="hi"), Endpoint.COMPLETIONS).stream
    assert not parse_body(raw(model="m", prompt="hi", stream=None), Endpoint.COMPLETIONS).stream


def test_a_client_cache_salt_is_read_only_when_a_string() -> None:
    salted = parse_body(raw(model="m", prompt="x", cache_salt="abc"), Endpoint.COMPLETIONS)
    assert salted.client_cache_salt == "abc"
    odd = parse_body(raw(model="m", prompt="x", cache_salt=5), Endpoint.COMPLETIONS)
    assert odd.client_cache_salt is None


def test_invalid_json_is_refused_without_echoing_it() -> None:
    error = bad(b'{"model": "m", "prompt": "' + SECRET_PROMPT.encode())
    assert "not valid JSON" in str(error)
    assert error.param is None


def test_a_body_that_is_not_an_object_is_refused() -> None:
    error = bad(json.dumps([SECRET_PROMPT]).encode())
    assert "JSON object" in str(error)


@pytest.mark.parametrize("model", [None, "", 5, [SECRET_PROMPT]])
def test_a_missing_or_bad_model_is_refused(model: object) -> None:
    body = {"prompt": SECRET_PROMPT} if model is None else {"model": model, "prompt": SECRET_PROMPT}
    assert bad(json.dumps(body).encode()).param == "model"


def test_a_stream_flag_that_is_not_a_boolean_is_refused() -> None:
    error = bad(raw(model="m", prompt=SECRET_PROMPT, stream=SECRET_PROMPT))
    assert error.param == "stream"


def test_completions_need_a_prompt() -> None:
    assert bad(raw(model="m", messages=[])).param == "prompt"


def test_chat_needs_a_list_of_messages() -> None:
    assert bad(raw(model="m", prompt=SECRET_PROMPT), Endpoint.CHAT).param == "messages"
    assert bad(raw(model="m", messages=SECRET_PROMPT), Endpoint.CHAT).param == "messages"


# -- prompt_input --------------------------------------------------------------------------


def prompt_token_ids(request: ParsedRequest, tokenizer: PromptTokenizer) -> list[int] | None:
    """The prompt as the engine tokenises it: the text whole, or the ids given."""
    prompt = prompt_input(request, tokenizer)
    return prompt.whole_tokens(tokenizer) if isinstance(prompt, PromptText) else prompt


def completions(prompt: object) -> ParsedRequest:
    return parse_body(raw(model="m", prompt=prompt), Endpoint.COMPLETIONS)


def chat(**body: object) -> ParsedRequest:
    return parse_body(raw(model="m", **body), Endpoint.CHAT)


def test_a_string_prompt_is_encoded_with_bos(tokenizer: PromptTokenizer) -> None:
    tokens = prompt_token_ids(completions("Hello there"), tokenizer)
    assert tokens is not None
    assert tokens[0] == BOS
    assert tokens == tokenizer.completion_tokens("Hello there")
    assert tokenizer.decode(tokens) == "Hello there"


def test_a_token_prompt_is_taken_as_it_is(tokenizer: PromptTokenizer) -> None:
    assert prompt_token_ids(completions([5, 6, 7]), tokenizer) == [5, 6, 7]


def test_a_batch_routes_on_its_first_prompt(tokenizer: PromptTokenizer) -> None:
    tokens = prompt_token_ids(completions(["first prompt", "second"]), tokenizer)
    assert tokens == tokenizer.completion_tokens("first prompt")
    assert prompt_token_ids(completions([[9, 8], [7]]), tokenizer) == [9, 8]


@pytest.mark.parametrize("prompt", [[], [-1, 2], [1.5], 42, None, {"text": "x"}])
def test_prompts_it_cannot_tokenise_give_none(prompt: object, tokenizer: PromptTokenizer) -> None:
    assert prompt_token_ids(completions(prompt), tokenizer) is None


def test_chat_messages_go_through_the_template(tokenizer: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    tokens = prompt_token_ids(chat(messages=messages), tokenizer)
    assert tokens == tokenizer.chat_tokens(messages)
    assert tokens is not None
    assert tokens.count(BOS) == 1
    without = prompt_token_ids(chat(messages=messages, add_generation_prompt=False), tokenizer)
    assert without == tokenizer.chat_tokens(messages, add_generation_prompt=False)
    assert without != tokens


def test_text_parts_are_joined_as_the_engine_joins_them(tokenizer: PromptTokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    tokens = prompt_token_ids(chat(messages=[{"role": "user", "content": parts}]), tokenizer)
    assert tokens == tokenizer.chat_tokens([{"role": "user", "content": "Hello\nthere"}])
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    assert prompt_token_ids(chat(messages=[{"role": "user", "content": image}]), tokenizer) is None


def test_a_failing_template_gives_none(tokenizer: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_token_ids(chat(messages=[1, 2]), tokenizer) is None
    reserved = chat(messages=messages, chat_template_kwargs={"chat_template": "{{ 1/0 }}"})
    assert prompt_token_ids(reserved, tokenizer) is None
    assert prompt_token_ids(chat(messages=messages, chat_template_kwargs=[1]), tokenizer) is None


# -- body_for_engine ---------------------------------------------------------------------


def test_without_a_salt_the_body_goes_upstream_byte_for_byte() -> None:
    data = b'{ "model" : "m",  "prompt": "hi", "n": 1 }'
    parsed = parse_body(data, Endpoint.COMPLETIONS)
    assert body_for_engine(data, parsed, None) is data


def test_a_salt_is_set_and_everything_else_kept() -> None:
    data = raw(model="m", prompt="hi", temperature=0.5, cache_salt="client-salt")
    parsed = parse_body(data, Endpoint.COMPLETIONS)
    sent = msgspec.json.decode(body_for_engine(data, parsed, "tenant-salt"))
    assert sent == {"model": "m", "prompt": "hi", "temperature": 0.5, "cache_salt": "tenant-salt"}


def test_without_a_salt_a_clients_own_salt_goes_upstream() -> None:
    data = raw(model="m", prompt="hi", cache_salt="client-salt")
    parsed = parse_body(data, Endpoint.COMPLETIONS)
    assert body_for_engine(data, parsed, None) is data


def test_a_body_with_the_salt_already_set_is_unchanged() -> None:
    data = raw(model="m", prompt="hi", cache_salt="tenant-salt")
    parsed = parse_body(data, Endpoint.COMPLETIONS)
    assert body_for_engine(data, parsed, "tenant-salt") is data


# -- usage -------------------------------------------------------------------------------


def usage_body(cached: object) -> bytes:
    return raw(usage={"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": cached}})


def test_a_response_reports_its_cached_tokens() -> None:
    assert response_usage(usage_body(32)) == Usage(cached_tokens=32, prompt_tokens=40)
    assert response_usage(usage_body(0)) == Usage(cached_tokens=0, prompt_tokens=40)


@pytest.mark.parametrize("cached", [-1, 1.5, "32", True, None])
def test_an_odd_cached_token_count_is_no_count(cached: object) -> None:
    assert response_usage(usage_body(cached)) == Usage(cached_tokens=None, prompt_tokens=40)


def test_usage_without_details_has_no_count() -> None:
    assert response_usage(raw(usage={"prompt_tokens": 40})) == Usage(
        cached_tokens=None, prompt_tokens=40
    )


@pytest.mark.parametrize("count", [-1, 1.5, "40", True, None])
def test_an_odd_prompt_token_count_is_no_count(count: object) -> None:
    body = raw(usage={"prompt_tokens": count, "prompt_tokens_details": {"cached_tokens": 8}})
    assert response_usage(body) == Usage(cached_tokens=8, prompt_tokens=None)


def test_a_response_without_usage_has_none() -> None:
    assert response_usage(raw(choices=[])) is None
    assert response_usage(raw(usage=None)) is None
    assert response_usage(b"not json") is None
    assert response_usage(b"[1, 2]") is None


def sse(*chunks: object) -> bytes:
    events = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


CONTENT = {"choices": [{"index": 0, "delta": {"content": "hello"}}]}
FINAL = {
    "choices": [],
    "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 24}},
}


def test_a_stream_reports_the_usage_chunk() -> None:
    stream = StreamUsage()
    stream.feed(sse(CONTENT, CONTENT, FINAL))
    assert stream.usage() == Usage(cached_tokens=24, prompt_tokens=40)


def test_the_usage_chunk_is_found_when_split_across_feeds() -> None:
    data = sse(CONTENT, FINAL)
    stream = StreamUsage()
    for start in range(0, len(data), 7):
        stream.feed(data[start : start + 7])
    assert stream.usage() == Usage(cached_tokens=24, prompt_tokens=40)


def test_a_long_stream_keeps_its_usage_at_the_end() -> None:
    stream = StreamUsage()
    for _ in range(2000):
        stream.feed(sse(CONTENT)[: -len(b"data: [DONE]\n\n")])
    stream.feed(sse(FINAL))
    assert stream.usage() == Usage(cached_tokens=24, prompt_tokens=40)


def test_a_stream_without_usage_has_none() -> None:
    stream = StreamUsage()
    stream.feed(sse(CONTENT, CONTENT))
    assert stream.usage() is None
    assert StreamUsage().usage() is None


def test_null_usage_on_every_chunk_does_not_hide_the_final_one() -> None:
    stream = StreamUsage()
    stream.feed(sse({**CONTENT, "usage": None}, FINAL))
    assert stream.usage() == Usage(cached_tokens=24, prompt_tokens=40)
    null_last = StreamUsage()
    null_last.feed(sse(FINAL, {**CONTENT, "usage": None}))
    assert null_last.usage() == Usage(cached_tokens=24, prompt_tokens=40)
    only_null = StreamUsage()
    only_null.feed(sse({**CONTENT, "usage": None}))
    assert only_null.usage() is None
