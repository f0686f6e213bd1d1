"""Prefill/decode disaggregation as vLLM's NixlConnector does it: a prefill simulator
and a decode simulator over real HTTP, the decode's KV events over real ZMQ."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvplane.core.serving import free_port
from simulations.engine_sim.app import RunningEngineSim
from simulations.engine_sim.config import EngineSimConfig
from tests.simulations.engine_sim.conftest import (
    decode_payload,
    engine_sim,
    metric,
    refused_at_start_up,
    subscribed,
)
from tests.waiting import wait_until

BLOCK = 16
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# Token ids, so that a longer prompt shares the shorter one's blocks exactly: 4 full
# blocks and 6 tokens, and 6 full blocks and 4 tokens.
PROMPT = list(range(10, 80))
LONGER = PROMPT + list(range(100, 130))
# vLLM 0.34's answer to a request whose KV load failed under the "fail" policy.
GENERATION_ERROR = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
# What vLLM's toy proxy sends with the prefill leg.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@contextlib.asynccontextmanager
async def pd_pair(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, RunningEngineSim]]:
    """A prefill and a decode simulator (settings over the roles' defaults); yields a
    client of each, and the decode simulator."""
    prefill_settings = {"kv_transfer_config": {**NIXL, "kv_role": "kv_producer"}, **(prefill or {})}
    decode_settings = {"kv_transfer_config": {**NIXL, "kv_role": "kv_consumer"}, **(decode or {})}
    async with (
        engine_sim(**prefill_settings) as prefill_sim,
        engine_sim(**decode_settings) as decode_sim,
        httpx.AsyncClient(base_url=prefill_sim.base_url) as prefill_client,
        httpx.AsyncClient(base_url=decode_sim.base_url) as decode_client,
    ):
        yield prefill_client, decode_client, decode_sim


async def prefill_leg(client: httpx.AsyncClient, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def decode_leg(
    client: httpx.AsyncClient, prompt: list[int], params: dict[str, Any], **extra: Any
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params, **extra}
    return await client.post("/v1/completions", json=body)


async def transfer_params(client: httpx.AsyncClient, prompt: list[int]) -> dict[str, Any]:
    params: dict[str, Any] = (await prefill_leg(client, prompt))["kv_transfer_params"]
    return params


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    details = response.json()["usage"]["prompt_tokens_details"]
    return 0 if details is None else int(details["cached_tokens"])


async def fault(client: httpx.AsyncClient, **settings: Any) -> None:
    response = await client.post("/sim/faults", json=settings)
    assert response.status_code == 200, response.text


async def prompt_tokens(client: httpx.AsyncClient) -> dict[str, float]:
    """vllm:prompt_tokens_by_source, by source."""
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    name = "vllm:prompt_tokens_by_source_total"
    return {source: await metric(client, name, source=source) for source in sources}


async def prefix_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The local and external prefix-cache counters, and the cached tokens by tier."""
    names = (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "external_prefix_cache_queries",
        "external_prefix_cache_hits",
        "prompt_tokens_cached",
    )
    counters = {name: await metric(client, f"vllm:{name}_total") for name in names}
    for tier in ("device", "p2p"):
        cached_by_source = "vllm:prompt_tokens_cached_by_source_total"
        counters[tier] = await metric(client, cached_by_source, source=tier)
    return counters


def failure_logged(caplog: pytest.LogCaptureFixture, reason: str) -> bool:
    """Whether the decode engine logged a KV load failure for this reason (the client
    is told only vLLM's "Internal server error")."""
    return any(
        "KV load failed" in record.getMessage() and reason in record.getMessage()
        for record in caplog.records
    )


async def blocks(client: httpx.AsyncClient) -> dict[str, Any]:
    listing: dict[str, Any] = (await client.get("/sim/blocks")).json()
    return listing


def full_blocks(prompt: list[int]) -> int:
    assert len(prompt) % BLOCK, "a prompt that fills its last block keeps that one to compute"
    return len(prompt) // BLOCK


async def test_a_prefill_leg_answers_vllm_transfer_params_and_pins_its_blocks() -> None:
    async with (
        engine_sim(kv_transfer_config=NIXL) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        answer = await prefill_leg(client, PROMPT)
        pinned = await blocks(client)
        second = await prefill_leg(client, LONGER)
        plain = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    params = answer["kv_transfer_params"]
    assert list(params) == [
        "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
        "remote_request_id", "remote_host", "remote_port", "tp_size", "remote_num_tokens",
        "remote_prefill_cached_tokens",
    ]  # fmt: skip
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_request_id"] == answer["id"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", sim.http_port)
    assert params["tp_size"] == 1
    assert params["remote_num_tokens"] == len(PROMPT)
    # The leg's own prompt-cache hits: none the first time; the longer prompt's second
    # leg finds the first one's (lent) full blocks.
    assert params["remote_prefill_cached_tokens"] == 0
    assert (
        second["kv_transfer_params"]["remote_prefill_cached_tokens"] == full_blocks(PROMPT) * BLOCK
    )
    assert answer["choices"][0]["finish_reason"] == "length"
    # One list of block ids per attention group: every block the prompt fills, the
    # partial last one included.
    (block_ids,) = params["remote_block_ids"]
    assert len(block_ids) == -(-len(PROMPT) // BLOCK)
    # Lent: held by nothing else, still not free.
    assert pinned["num_free_blocks"] == pinned["num_blocks"] - len(block_ids)
    assert [block["ref_cnt"] for block in pinned["blocks"]] == [1] * full_blocks(PROMPT)
    # One id per incarnation of the engine.
    assert second["kv_transfer_params"]["remote_engine_id"] == params["remote_engine_id"]
    assert "kv_transfer_params" not in plain.json()


async def test_a_decode_leg_pulls_the_prompt_and_publishes_the_blocks_it_got() -> None:
    async with pd_pair() as (prefill, decode, decode_sim), subscribed(decode_sim) as subscriber:
        params = await transfer_params(prefill, PROMPT)
        prefill_hashes = {block["hash"] for block in (await blocks(prefill))["blocks"]}
        response = await decode_leg(decode, PROMPT, params)
        messages = await subscriber.drain()
        released = await blocks(prefill)
        pulls = await metric(decode, "vllm:nixl_xfer_time_seconds_count")
        pulled_bytes = await metric(decode, "vllm:nixl_bytes_transferred_sum")
        pulled_blocks = await metric(decode, "kvplane_sim:kv_pulled_blocks_total")
        by_source = await prompt_tokens(decode)
        counters = await prefix_counters(decode)
    full = full_blocks(PROMPT)
    # The usage reports the prefill's own hits (none), as vLLM 0.34's decode does.
    assert cached_tokens(response) == 0
    assert response.json()["choices"][0]["finish_reason"] == "length"
    # The pulled tokens are external, not local prefix-cache hits.
    assert by_source == {
        "local_compute": len(PROMPT) - full * BLOCK,
        "local_cache_hit": 0,
        "external_kv_transfer": full * BLOCK,
    }
    assert counters == {
        "prefix_cache_queries": len(PROMPT),
        "prefix_cache_hits": 0,
        "external_prefix_cache_queries": len(PROMPT),
        "external_prefix_cache_hits": full * BLOCK,
        "prompt_tokens_cached": full * BLOCK,
        "device": 0,
        "p2p": full * BLOCK,
    }
    # The pulled blocks are ordinary cached blocks now: the engine's first event stores
    # exactly the prefill's blocks, as a chain from token 0.
    first = decode_payload(messages[0][2])[1][0]
    assert first["type"] == "BlockStored"
    assert first["parent_block_hash"] is None
    assert first["token_ids"] == PROMPT[: full * BLOCK]
    assert set(first["block_hashes"]) == prefill_hashes
    assert len(first["block_hashes"]) == full
    # The prefill let go of them when they were pulled.
    assert released["num_free_blocks"] == released["num_blocks"]
    assert (pulls, pulled_blocks) == (1, full)
    assert pulled_bytes == full * BLOCK * 131_072


async def test_a_longer_prompt_pulls_only_the_blocks_the_decode_lacks() -> None:
    async with pd_pair() as (prefill, decode, _):
        await decode_leg(decode, PROMPT, await transfer_params(prefill, PROMPT))
        response = await decode_leg(decode, LONGER, await transfer_params(prefill, LONGER))
        pulled_blocks = await metric(decode, "kvplane_sim:kv_pulled_blocks_total")
        pulls = await metric(decode, "vllm:nixl_xfer_time_seconds_count")
        released = await blocks(prefill)
        by_source = await prompt_tokens(decode)
    # The prefill found the shorter prompt's blocks, and so does the decode's usage.
    assert cached_tokens(response) == full_blocks(PROMPT) * BLOCK
    assert pulled_blocks == full_blocks(LONGER)  # the shorter prompt's, then the rest
    # The second leg: the shorter prompt's blocks are local hits, the rest external.
    assert by_source["local_cache_hit"] == full_blocks(PROMPT) * BLOCK
    assert by_source["external_kv_transfer"] == full_blocks(LONGER) * BLOCK
    assert pulls == 2
    assert released["num_free_blocks"] == released["num_blocks"]


async def test_a_decode_that_holds_the_whole_prompt_pulls_nothing_and_frees_the_prefill() -> None:
    async with pd_pair() as (prefill, decode, _):
        await decode.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        response = await decode_leg(decode, PROMPT, await transfer_params(prefill, PROMPT))
        pulls = await metric(decode, "vllm:nixl_xfer_time_seconds_count")
        by_source = await prompt_tokens(decode)

        async def released() -> bool:
            # The release goes out when the leg is scheduled, beside its step.
            listing = await blocks(prefill)
            return bool(listing["num_free_blocks"] == listing["num_blocks"])

        await wait_until("the prefill to free its blocks", released)
    assert cached_tokens(response) == 0  # the prefill's hits
    assert by_source["local_cache_hit"] == full_blocks(PROMPT) * BLOCK
    assert by_source["external_kv_transfer"] == 0
    assert pulls == 0


# A decode engine of 10 blocks whose steps take real time (100 ms a decode step), so that
# other requests hold its blocks while a decode leg arrives.
SMALL_SLOW_DECODE = {"num_gpu_blocks_override": 10, "time_scale": 1.0, "decode_step_ms": 100.0}
FETCH = "vllm:num_requests_kv_fetch_by_stage"


async def test_a_decode_leg_waits_for_blocks_held_by_running_requests_then_pulls() -> None:
    # 140 tokens and 8 more: all 10 blocks, held while the request runs (about 0.8 s).
    filler = {"prompt": list(range(200, 340)), "max_tokens": 8}
    async with pd_pair(decode=SMALL_SLOW_DECODE) as (prefill, decode, _):
        params = await transfer_params(prefill, PROMPT)
        running = asyncio.create_task(decode.post("/v1/completions", json=filler))
        await wait_until("the filler to run", lambda: metric(decode, "vllm:num_requests_running"))
        leg = asyncio.create_task(decode_leg(decode, PROMPT, params))
        await wait_until(
            "the leg to wait for blocks", lambda: metric(decode, FETCH, stage="waiting_to_start")
        )
        waiting = {
            "pulls": await metric(decode, "vllm:nixl_xfer_time_seconds_count"),
            "computed": (await prompt_tokens(decode))["local_compute"],
            "filler_done": running.done(),
        }
        still_lent = await blocks(prefill)
        response = await leg
        assert (await running).status_code == 200
        by_source = await prompt_tokens(decode)
        pulled_blocks = await metric(decode, "kvplane_sim:kv_pulled_blocks_total")
        preemptions = await metric(decode, "vllm:num_preemptions_total")
        stages = {
            stage: await metric(decode, FETCH, stage=stage)
            for stage in ("waiting_to_start", "in_progress", "completed_waiting")
        }
    # While the filler held every block, the leg neither pulled nor computed anything.
    assert waiting == {"pulls": 0, "computed": 140, "filler_done": False}
    assert still_lent["num_free_blocks"] < still_lent["num_blocks"]
    # Once they freed, it pulled its blocks and computed only the partial last one.
    assert response.status_code == 200, response.text
    assert by_source == {
        "local_compute": 140 + len(PROMPT) - full_blocks(PROMPT) * BLOCK,
        "local_cache_hit": 0,
        "external_kv_transfer": full_blocks(PROMPT) * BLOCK,
    }
    assert pulled_blocks == full_blocks(PROMPT)
    assert preemptions == 0
    assert stages == {"waiting_to_start": 0, "in_progress": 0, "completed_waiting": 0}


def pulled_in(transfer_s: float) -> dict[str, float]:
    """A decode engine's transfer model under which PROMPT's full blocks take
    `transfer_s` to pull."""
    return {
        "kv_bytes_per_token": 1000,
        "kv_transfer_bytes_per_s": full_blocks(PROMPT) * BLOCK * 1000 / transfer_s,
    }


async def test_pulled_blocks_belong_to_the_decode_leg_until_it_runs() -> None:
    decode_settings = {
        **SMALL_SLOW_DECODE,
        "max_num_seqs": 1,  # a running request keeps the pulled leg waiting
        # the filler reaches its 7th block about 1.6 s after it starts
        **pulled_in(0.6),
    }
    # 5 full blocks, growing to 7: more than the cache has beside the leg's 4 (and the
    # one it reserves for its last tokens).
    filler = {"prompt": list(range(200, 280)), "max_tokens": 20}
    async with (
        pd_pair(decode=decode_settings) as (prefill, decode, decode_sim),
        subscribed(decode_sim) as subscriber,
    ):
        # A cached prefix the filler's allocations evict: 3 full blocks, now free.
        await decode.post(
            "/v1/completions", json={"prompt": list(range(400, 450)), "max_tokens": 1}
        )
        params = await transfer_params(prefill, PROMPT)
        leg = asyncio.create_task(decode_leg(decode, PROMPT, params))
        await wait_until("the pull", lambda: metric(decode, FETCH, stage="in_progress"))
        running = asyncio.create_task(decode.post("/v1/completions", json=filler))
        await wait_until("the filler to run", lambda: metric(decode, "vllm:num_requests_running"))
        await wait_until(
            "the pulled leg to wait", lambda: metric(decode, FETCH, stage="completed_waiting")
        )
        scheduler = decode_sim.engine.scheduler
        (pulled_leg,) = scheduler.loaded
        held = decode_sim.engine.kv_cache.blocks_of(pulled_leg)
        window = {
            "ref_cnts": [block.ref_cnt for block in held],
            "free": decode_sim.engine.pool.num_free_blocks,
            "filler_done": running.done(),
        }
        response = await leg
        assert (await running).status_code == 200
        messages = await subscriber.drain()
        by_source = await prompt_tokens(decode)
        preemptions = await metric(decode, "vllm:num_preemptions_total")
    # The leg holds its pulled blocks: no allocation can take them.
    assert window == {"ref_cnts": [1] * full_blocks(PROMPT), "free": 0, "filler_done": False}
    events = [event for message in messages for event in decode_payload(message[2])[1]]
    (stored_at,) = [
        index
        for index, event in enumerate(events)
        if event["type"] == "BlockStored"
        and event["token_ids"] == PROMPT[: full_blocks(PROMPT) * BLOCK]
    ]
    removed_before = [
        block_hash
        for event in events[:stored_at]
        if event["type"] == "BlockRemoved"
        for block_hash in event["block_hashes"]
    ]
    # Meanwhile the filler's allocations evicted the first request's 3 cached blocks,
    # and at its 7th block, finding none free, it was preempted: the leg's were not
    # free to take. They entered the cache once, when the leg's turn came.
    assert len(removed_before) == 3
    assert preemptions == 1
    # The leg ran from what it pulled: only its partial last block was computed (besides
    # the first request's 50 tokens and the filler's 80, counted once).
    assert response.status_code == 200, response.text
    assert by_source == {
        "local_compute": 50 + 80 + len(PROMPT) - full_blocks(PROMPT) * BLOCK,
        "local_cache_hit": 0,
        "external_kv_transfer": full_blocks(PROMPT) * BLOCK,
    }


async def test_a_leg_aborted_while_its_kv_arrives_frees_its_blocks_when_the_transfer_ends() -> None:
    decode_settings = {"time_scale": 1.0, **pulled_in(1.5)}
    async with pd_pair(decode=decode_settings) as (prefill, decode, decode_sim):
        params = await transfer_params(prefill, PROMPT)
        leg = asyncio.create_task(decode_leg(decode, PROMPT, params))
        await wait_until("the pull", lambda: metric(decode, FETCH, stage="in_progress"))
        leg.cancel()  # the client goes away during the pull
        with contextlib.suppress(asyncio.CancelledError):
            await leg
        await wait_until("the abort", lambda: not decode_sim.engine.scheduler.loading)
        during = await blocks(decode)
        await wait_until(
            "the transfer to end", lambda: metric(decode, "vllm:nixl_xfer_time_seconds_count")
        )
        await wait_until(
            "the blocks to free",
            lambda: decode_sim.engine.pool.num_free_blocks == decode_sim.engine.pool.num_blocks,
        )
        after = await decode_leg(decode, PROMPT, await transfer_params(prefill, PROMPT))
    # The transfer still writes into the aborted leg's blocks: they stay held until it ends.
    assert during["num_free_blocks"] == during["num_blocks"] - full_blocks(PROMPT)
    assert after.status_code == 200, after.text


async def test_the_transfer_takes_its_bytes_over_the_bandwidth() -> None:
    transfer_s = 0.3
    link = full_blocks(PROMPT) * BLOCK * 1000 / transfer_s  # bytes a second
    decode_settings = {
        "time_scale": 1.0,
        "kv_bytes_per_token": 1000,
        "kv_transfer_bytes_per_s": link,
    }
    async with pd_pair(decode=decode_settings) as (prefill, decode, _):
        params = await transfer_params(prefill, PROMPT)
        start = time.perf_counter()
        response = await decode_leg(decode, PROMPT, params, max_tokens=1)
        elapsed = time.perf_counter() - start
        recorded = await metric(decode, "vllm:nixl_xfer_time_seconds_sum")
        pulled = (await prompt_tokens(decode))["external_kv_transfer"]
    assert response.status_code == 200, response.text
    assert pulled == full_blocks(PROMPT) * BLOCK
    assert recorded == pytest.approx(transfer_s)
    assert transfer_s <= elapsed < transfer_s + 1.0


async def test_no_params_fault_answers_like_an_older_release_at_eos_and_lends_nothing() -> None:
    async with (
        engine_sim(kv_transfer_config=NIXL) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        await fault(client, pd_no_params=True)
        withheld = await prefill_leg(client, PROMPT)
        listing = await blocks(client)
        await fault(client, pd_no_params=False)
        again = await prefill_leg(client, PROMPT)
    assert "kv_transfer_params" not in withheld
    assert withheld["choices"][0]["finish_reason"] == "stop"
    assert listing["num_free_blocks"] == listing["num_blocks"]
    assert again["kv_transfer_params"]["do_remote_prefill"] is True


async def test_a_refused_transfer_fails_the_request_under_the_fail_policy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with pd_pair() as (prefill, decode, _):
        params = await transfer_params(prefill, PROMPT)
        await fault(prefill, pd_fail_transfer=True)
        response = await decode_leg(decode, PROMPT, params)
        streamed = await decode_leg(decode, PROMPT, params, stream=True)
        messages = [{"role": "user", "content": "a prompt of two blocks or so " * 4}]
        chat = {"messages": messages, "max_tokens": 2, "stream": True}
        chat_streamed = await decode.post(
            "/v1/chat/completions", json={**chat, "kv_transfer_params": params}
        )
        failed = await metric(decode, "vllm:nixl_num_failed_transfers_total")
        freed = await blocks(decode)  # the failed requests' blocks
        await fault(prefill, pd_fail_transfer=False)
        recovered = await decode_leg(decode, PROMPT, params)
        pulled = (await prompt_tokens(decode))["external_kv_transfer"]
    # vLLM's GenerationError, the same whatever the cause; the cause is only logged.
    assert response.status_code == 500
    assert response.json() == GENERATION_ERROR
    assert failure_logged(caplog, "refused")
    # Streamed: 200, the error as an event, the end (json.dumps' spacing, as vLLM's
    # completion stream writes it).
    assert streamed.status_code == 200
    assert streamed.text == f"data: {json.dumps(GENERATION_ERROR)}\n\ndata: [DONE]\n\n"
    # A chat stream sends its role chunk first, as vLLM does with the failed output.
    assert chat_streamed.status_code == 200
    events = [line for line in chat_streamed.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 3
    role = json.loads(events[0][len("data: ") :])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(events[1][len("data: ") :]) == GENERATION_ERROR
    assert events[2] == "data: [DONE]"
    assert failed == 3
    assert freed["num_free_blocks"] == freed["num_blocks"]
    # The blocks stayed lent while pulls were refused.
    assert recovered.status_code == 200, recovered.text
    assert pulled == full_blocks(PROMPT) * BLOCK


async def test_a_refused_transfer_is_recomputed_under_the_recompute_policy() -> None:
    recompute = {"kv_transfer_config": {**NIXL, "kv_load_failure_policy": "recompute"}}
    async with pd_pair(decode=recompute) as (prefill, decode, _):
        # The decode engine holds the first two blocks already.
        await decode.post("/v1/completions", json={"prompt": PROMPT[:40], "max_tokens": 1})
        params = await transfer_params(prefill, PROMPT)
        await fault(prefill, pd_fail_transfer=True)
        response = await decode_leg(decode, PROMPT, params)
        failed = await metric(decode, "vllm:nixl_num_failed_transfers_total")
        by_source = await prompt_tokens(decode)
    assert response.json()["usage"]["completion_tokens"] == 2
    # The usage still reports the prefill's hits (vLLM reads them from the parameters);
    # the engine computed all but its own two blocks.
    assert cached_tokens(response) == 0
    assert by_source["local_cache_hit"] == 2 * BLOCK
    assert by_source["external_kv_transfer"] == 0
    assert by_source["local_compute"] == 40 + len(PROMPT) - 2 * BLOCK
    assert failed == 1


async def test_an_expired_lease_frees_the_blocks_and_fails_the_pull(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with pd_pair() as (prefill, decode, _):
        await fault(prefill, pd_lease_s=0)
        params = await transfer_params(prefill, PROMPT)
        await wait_until(
            "the lease to expire",
            lambda: metric(prefill, "vllm:nixl_num_kv_expired_reqs_total"),
        )
        freed = await blocks(prefill)
        response = await decode_leg(decode, PROMPT, params)
        await fault(prefill, pd_lease_s=None)  # the configured lease again
        await transfer_params(prefill, PROMPT)
        lent = await blocks(prefill)
    assert freed["num_free_blocks"] == freed["num_blocks"]
    assert response.status_code == 500
    assert response.json() == GENERATION_ERROR
    assert failure_logged(caplog, "lease expired")
    assert lent["num_free_blocks"] < lent["num_blocks"]


@pytest.mark.parametrize("wrong", ["engine", "request", "address"])
async def test_a_pull_that_finds_no_blocks_fails(
    wrong: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with pd_pair() as (prefill, decode, _):
        params = await transfer_params(prefill, PROMPT)
        if wrong == "engine":  # as after a prefill restart
            params["remote_engine_id"] = "another-engine"
        elif wrong == "request":
            params["remote_request_id"] = "cmpl-unknown"
        else:
            params["remote_port"] = free_port()
        response = await decode_leg(decode, PROMPT, params)
        still_lent = await blocks(prefill)
    assert response.status_code == 500
    assert response.json() == GENERATION_ERROR
    expected = {"engine": "not another-engine", "request": "cmpl-unknown", "address": "answer"}
    assert failure_logged(caplog, expected[wrong])
    assert still_lent["num_free_blocks"] < still_lent["num_blocks"]


async def test_the_pull_endpoint_hands_blocks_over_once() -> None:
    async with (
        engine_sim(kv_transfer_config=NIXL) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        params = await transfer_params(client, PROMPT)
        pull = {
            "remote_request_id": params["remote_request_id"],
            "remote_engine_id": params["remote_engine_id"],
            "num_blocks": 3,
        }
        too_many = await client.post("/sim/kv/pull", json={**pull, "num_blocks": 9})
        taken = await client.post("/sim/kv/pull", json=pull)
        again = await client.post("/sim/kv/pull", json=pull)
    assert too_many.status_code == 409
    assert (taken.status_code, taken.json()) == (200, {"num_blocks": 3})
    assert again.status_code == 404


async def test_the_metric_families_tell_a_producer_from_a_consumer_as_vllms_do() -> None:
    families = {}
    async with contextlib.AsyncExitStack() as stack:
        for role in ("kv_producer", "kv_consumer", "kv_both", None):
            config = {} if role is None else {"kv_transfer_config": {**NIXL, "kv_role": role}}
            sim = await stack.enter_async_context(engine_sim(**config))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=sim.base_url))
            text = (await client.get("/metrics")).text
            families[role] = {
                family.name: family for family in text_string_to_metric_families(text)
            }
            if role is None:
                refused = await client.post("/sim/faults", json={"pd_fail_transfer": True})
                no_pull = await client.post("/sim/kv/pull", json={})
    fetch = "vllm:num_requests_kv_fetch_by_stage"
    for role, names in families.items():
        # vLLM labels no metric with its kv_transfer_config.
        assert not any("kv_transfer_config" in name for name in names)
        # NixlConnector's families exist with the connector, whatever its role.
        assert ("vllm:nixl_num_failed_transfers" in names) is (role is not None)
        # The KV-fetch gauge only where the engine consumes KV.
        assert (fetch in names) is (role in ("kv_consumer", "kv_both"))
        # Prompt tokens by source, and the external prefix cache: always, as in vLLM.
        assert "vllm:prompt_tokens_by_source" in names
        assert "vllm:external_prefix_cache_hits" in names
    stages = {
        sample.labels["stage"]: sample.value for sample in families["kv_consumer"][fetch].samples
    }
    assert stages == {"waiting_to_start": 0, "in_progress": 0, "completed_waiting": 0}
    (sample, *_) = families["kv_consumer"][fetch].samples
    assert list(sample.labels) == ["engine", "model_name", "stage"]
    assert refused.status_code == 409
    assert no_pull.status_code == 404


async def test_the_fetch_gauge_counts_a_decode_leg_while_it_pulls() -> None:
    decode_settings = {"time_scale": 1.0, **pulled_in(0.5)}
    fetch = "vllm:num_requests_kv_fetch_by_stage"
    async with pd_pair(decode=decode_settings) as (prefill, decode, _):
        params = await transfer_params(prefill, PROMPT)
        leg = asyncio.create_task(decode_leg(decode, PROMPT, params, max_tokens=1))
        await wait_until(
            "the pull to be in progress",
            lambda: metric(decode, fetch, stage="in_progress"),
        )
        response = await leg
        after = {
            stage: await metric(decode, fetch, stage=stage)
            for stage in ("waiting_to_start", "in_progress", "completed_waiting")
        }
    assert response.status_code == 200, response.text
    assert after == {"waiting_to_start": 0, "in_progress": 0, "completed_waiting": 0}


async def test_a_decode_leg_reports_the_prefills_cached_tokens_as_vllm_034() -> None:
    async with pd_pair() as (prefill, decode, _):
        await prefill_leg(prefill, PROMPT)
        params = await transfer_params(prefill, LONGER)  # finds the first leg's blocks
        told = await decode_leg(decode, LONGER, {**params, "remote_prefill_cached_tokens": 7})
        fresh = await transfer_params(prefill, PROMPT)
        older = {
            key: value for key, value in fresh.items() if key != "remote_prefill_cached_tokens"
        }
        own = await decode_leg(decode, PROMPT, older)
        two_tokens = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": REMOTE_DECODE}
        longer_leg = (await prefill.post("/v1/completions", json=two_tokens)).json()
    async with (
        engine_sim() as plain_sim,
        httpx.AsyncClient(base_url=plain_sim.base_url) as plain,
    ):
        remote = {"do_remote_prefill": True, "remote_prefill_cached_tokens": 5}
        without_connector = await decode_leg(plain, PROMPT, remote)
    assert params["remote_prefill_cached_tokens"] == full_blocks(PROMPT) * BLOCK
    assert cached_tokens(told) == 7
    # Without the key (an older prefill engine), the decode's own hits.
    assert cached_tokens(own) == full_blocks(PROMPT) * BLOCK
    # A leg that generates past its first token has no prefill statistics to add.
    assert "remote_prefill_cached_tokens" not in longer_leg["kv_transfer_params"]
    # vLLM's output processor reads the key with or without a connector.
    assert cached_tokens(without_connector) == 5


def test_a_connector_needs_a_role_as_in_vllm_and_the_prefix_cache() -> None:
    config = EngineSimConfig(kv_transfer_config=json.dumps(NIXL))
    assert config.kv_transfer_config.kv_role == "kv_both"
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"
    with pytest.raises(ValidationError, match="Please specify kv_role"):
        EngineSimConfig(kv_transfer_config={"kv_connector": "NixlConnector"})
    with pytest.raises(ValidationError, match="enable-prefix-caching"):
        EngineSimConfig(kv_transfer_config=NIXL, enable_prefix_caching=False)


def test_another_connector_is_refused_at_start_up() -> None:
    stderr = refused_at_start_up(
        "--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'
    )
    assert "kv_transfer_config" in stderr
    assert "only NixlConnector" in stderr
