"""A disaggregated request's two bodies, and what the prefill leg's answer hands on, in
vLLM's NixlConnector protocol (router/lifecycle/legs.py); and a client's body may not
carry the router's `kv_transfer_params` (router/lifecycle/bodies.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.lifecycle.bodies import BadRequest, Endpoint, ParsedRequest, parse_body
from router.lifecycle.legs import (
    MissingParams,
    decode_leg_body,
    handed_on_params,
    leg_request_id,
    prefill_leg_body,
)

SECRET_PROMPT = "zebra-quartz-7731 confidential"
# What vLLM's toy P/D proxy asks of the prefill instance (disagg_proxy_server.py).
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What a prefill instance's NixlConnector answers with (request_finished's params).
HANDED_ON = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4, 5],
    "remote_engine_id": "0b6c7e0a-prefill-0",
    "remote_host": "10.1.2.3",
    "remote_port": 5600,
    "tp_size": 1,
}


def chat(**body: object) -> ParsedRequest:
    fields: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        **body,
    }
    return parse_body(json.dumps(fields).encode(), Endpoint.CHAT)


def completions(**body: object) -> ParsedRequest:
    return parse_body(
        json.dumps({"model": "m", "prompt": "hi", **body}).encode(), Endpoint.COMPLETIONS
    )


def decoded(body: bytes) -> dict[str, Any]:
    document = json.loads(body)
    assert isinstance(document, dict)
    return document


# -- prefill_leg_body ---------------------------------------------------------------------


def test_the_prefill_leg_asks_for_a_remote_decode_of_one_token_not_streamed() -> None:
    parsed = chat(
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=200,
        min_tokens=10,
        temperature=0.3,
        user="u-1",
    )
    assert decoded(prefill_leg_body(parsed, None)) == {
        "model": "m",
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        "stream": False,
        "max_tokens": 1,
        "temperature": 0.3,
        "user": "u-1",
        "kv_transfer_params": REMOTE_DECODE,
    }


def test_max_completion_tokens_is_one_only_where_the_client_set_it() -> None:
    with_it = decoded(
        prefill_leg_body(chat(max_completion_tokens=500, min_completion_tokens=9), None)
    )
    assert with_it["max_completion_tokens"] == 1
    assert with_it["max_tokens"] == 1
    assert "min_completion_tokens" not in with_it
    without = decoded(prefill_leg_body(chat(), None))
    assert "max_completion_tokens" not in without
    assert without["max_tokens"] == 1


def test_a_prefill_leg_without_a_length_still_gets_one_token() -> None:
    body = decoded(prefill_leg_body(completions(), None))
    assert body == {
        "model": "m",
        "prompt": "hi",
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": REMOTE_DECODE,
    }


def test_the_prefill_leg_carries_the_cache_salt_given() -> None:
    parsed = completions(cache_salt="client-salt")
    assert decoded(prefill_leg_body(parsed, "tenant-salt"))["cache_salt"] == "tenant-salt"
    assert decoded(prefill_leg_body(parsed, None))["cache_salt"] == "client-salt"
    assert "cache_salt" not in decoded(prefill_leg_body(completions(), None))


def test_building_the_prefill_leg_leaves_the_clients_body_as_it_was() -> None:
    parsed = chat(stream=True, max_tokens=7, stream_options={"include_usage": True})
    before = json.loads(json.dumps(parsed.body))
    prefill_leg_body(parsed, "salt")
    assert parsed.body == before


# -- decode_leg_body ----------------------------------------------------------------------


def test_the_decode_leg_is_the_clients_body_with_the_handed_on_params_verbatim() -> None:
    parsed = chat(
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=200,
        min_tokens=10,
        max_completion_tokens=300,
    )
    body = decoded(decode_leg_body(parsed, None, HANDED_ON))
    assert body == {**parsed.body, "kv_transfer_params": HANDED_ON}
    assert body["stream"] is True
    assert body["max_tokens"] == 200
    assert body["min_tokens"] == 10
    assert body["stream_options"] == {"include_usage": True}


def test_the_decode_leg_carries_the_cache_salt_given() -> None:
    parsed = completions(cache_salt="client-salt")
    assert decoded(decode_leg_body(parsed, "tenant-salt", HANDED_ON))["cache_salt"] == (
        "tenant-salt"
    )
    assert decoded(decode_leg_body(parsed, None, HANDED_ON))["cache_salt"] == "client-salt"
    assert "cache_salt" not in decoded(decode_leg_body(completions(), None, HANDED_ON))


def test_the_legs_share_a_fresh_request_id_each_request() -> None:
    first, second = leg_request_id(), leg_request_id()
    assert first != second
    assert first.startswith("kvplane-")
    assert first.isprintable()


# -- handed_on_params ---------------------------------------------------------------------


def answer(**document: object) -> bytes:
    fields: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": SECRET_PROMPT, "finish_reason": "length"}],
        **document,
    }
    return json.dumps(fields).encode()


def test_a_prefill_answers_params_are_handed_on_verbatim() -> None:
    params = handed_on_params(answer(kv_transfer_params=HANDED_ON))
    assert params == HANDED_ON
    assert list(params) == list(HANDED_ON)  # the engine's own order too


def missing(data: bytes) -> str:
    with pytest.raises(MissingParams) as caught:
        handed_on_params(data)
    assert SECRET_PROMPT not in str(caught.value)
    return str(caught.value)


def test_an_answer_without_params_hands_nothing_on() -> None:
    assert "no kv_transfer_params" in missing(answer())
    assert "no kv_transfer_params" in missing(answer(kv_transfer_params=None))


@pytest.mark.parametrize(
    "data", [b"", b"<html>Bad Gateway</html>", b'{"kv_transfer_params": ', SECRET_PROMPT.encode()]
)
def test_an_answer_that_is_not_json_hands_nothing_on(data: bytes) -> None:
    assert "not JSON" in missing(data)


@pytest.mark.parametrize("document", [[HANDED_ON], "kv_transfer_params", 7, None])
def test_an_answer_that_is_not_an_object_hands_nothing_on(document: object) -> None:
    assert "no kv_transfer_params" in missing(json.dumps(document).encode())


@pytest.mark.parametrize(
    "params",
    [
        [HANDED_ON],
        "do_remote_prefill",
        {**HANDED_ON, "do_remote_prefill": False},
        {**HANDED_ON, "do_remote_prefill": "true"},
        {**HANDED_ON, "do_remote_prefill": 1},
        {key: value for key, value in HANDED_ON.items() if key != "do_remote_prefill"},
        REMOTE_DECODE,
    ],
    ids=["list", "string", "false", "string-true", "one", "absent", "remote-decode"],
)
def test_params_not_for_a_remote_prefill_hand_nothing_on(params: object) -> None:
    assert "not for a remote prefill" in missing(answer(kv_transfer_params=params))


@pytest.mark.parametrize(
    "change",
    [
        {"remote_engine_id": None},
        {"remote_engine_id": 17},
        {"remote_block_ids": None},
        {"remote_block_ids": "3,4,5"},
        {"remote_block_ids": {"0": 3}},
    ],
)
def test_params_naming_no_engine_or_blocks_hand_nothing_on(change: dict[str, object]) -> None:
    assert "name no engine or blocks" in missing(answer(kv_transfer_params={**HANDED_ON, **change}))


@pytest.mark.parametrize("absent", ["remote_engine_id", "remote_block_ids"])
def test_params_without_an_engine_or_blocks_hand_nothing_on(absent: str) -> None:
    params = {key: value for key, value in HANDED_ON.items() if key != absent}
    assert "name no engine or blocks" in missing(answer(kv_transfer_params=params))


def test_no_blocks_is_still_a_list_to_hand_on() -> None:
    # A prompt shorter than a block: vLLM hands on an empty list, and the decode worker
    # computes the prompt itself.
    params = {**HANDED_ON, "remote_block_ids": []}
    assert handed_on_params(answer(kv_transfer_params=params)) == params


# -- parse_body ---------------------------------------------------------------------------


@pytest.mark.parametrize("params", [HANDED_ON, REMOTE_DECODE, None, {}])
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_a_client_may_not_set_kv_transfer_params(params: object, endpoint: Endpoint) -> None:
    body = {
        "model": "m",
        "prompt": SECRET_PROMPT,
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        "kv_transfer_params": params,
    }
    with pytest.raises(BadRequest) as caught:
        parse_body(json.dumps(body).encode(), endpoint)
    assert caught.value.param == "kv_transfer_params"
    assert caught.value.status == 400
    assert "set by the router" in str(caught.value)
    assert SECRET_PROMPT not in str(caught.value)
