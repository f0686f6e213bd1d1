"""Fault knobs and the `kvplane engine-sim` command, in real processes where it matters."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from kvplane.cli import main
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.process import spawn_engine_sim
from tests.simulations.engine_sim.conftest import engine_sim, refused_at_start_up
from tests.waiting import wait_until

PROMPT = "Write a Python function that returns the longest common prefix of two lists."


def test_help_documents_every_setting_with_vllm_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["engine-sim", "--help"])
    help_text = capsys.readouterr().out
    for name in EngineSimConfig.model_fields:
        assert "--" + name.replace("_", "-") in help_text
    for vllm_flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--tokenizer",
        "--block-size",
        "--num-gpu-blocks-override",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--kv-events-config",
    ):
        assert vllm_flag in help_text


def test_bad_flags_are_refused_with_a_clear_message() -> None:
    assert "--kv-events-config" in refused_at_start_up("--kv-events-config", "{oops")


def test_the_process_dies_on_the_request_after_its_limit() -> None:
    with spawn_engine_sim("--fail-after-requests", "2", "--time-scale", "0") as sim:
        with httpx.Client(base_url=sim.base_url) as client:
            for _ in range(2):
                response = client.post("/v1/completions", json={"prompt": PROMPT})
                assert response.status_code == 200
            try:
                client.post("/v1/completions", json={"prompt": PROMPT})
            except httpx.TransportError:
                pass  # the connection dies with the process: the point of the fault
            else:
                raise AssertionError("the third request was answered")
        assert sim.process.wait(timeout=10) == -signal.SIGKILL


def test_sigusr1_kills_the_process_like_a_crash() -> None:
    with spawn_engine_sim("--time-scale", "0") as sim:
        assert httpx.get(sim.base_url + "/health").status_code == 200
        sim.process.send_signal(signal.SIGUSR1)
        assert sim.process.wait(timeout=10) == -signal.SIGKILL


async def test_a_stall_holds_every_step_for_its_duration() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        assert (await client.post("/sim/faults", json={"stall_s": 0.5})).status_code == 200
        start = time.perf_counter()
        response = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert response.status_code == 200
        assert time.perf_counter() - start >= 0.45


async def test_a_restart_fails_the_requests_in_flight_and_forgets_the_cache() -> None:
    async with (
        engine_sim(time_scale=1.0, decode_step_ms=50.0) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        body = {"prompt": PROMPT, "max_tokens": 200}
        in_flight = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_until("the request runs", lambda: bool(sim.engine.scheduler.running))
        assert (await client.post("/sim/faults", json={"restart": True})).status_code == 200
        failed = await in_flight
        assert failed.status_code == 500
        assert "restarted" in failed.json()["error"]["message"]
        assert (await client.get("/sim/blocks")).json()["blocks"] == []
        again = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert again.json()["usage"]["prompt_tokens_details"] is None  # nothing cached


async def test_a_restart_zeroes_the_metrics_as_a_new_process_would() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        before = (await client.get("/metrics")).text
        await client.post("/sim/faults", json={"restart": True})
        after = (await client.get("/metrics")).text
    hits = 'vllm:prefix_cache_hits_total{engine="0",model_name="kvplane-tiny"}'
    assert f"{hits} 0.0" not in before
    assert f"{hits} 0.0" in after


async def test_dropping_events_without_events_is_refused() -> None:
    async with (
        engine_sim(kv_events_config={"enable_kv_cache_events": False}) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        response = await client.post("/sim/faults", json={"drop_event_fraction": 0.5})
    assert response.status_code == 409


async def test_a_failed_engine_loop_fails_its_requests_and_health() -> None:
    async with engine_sim() as sim, httpx.AsyncClient(base_url=sim.base_url) as client:
        scheduler = sim.engine.scheduler

        def broken_schedule() -> None:
            raise RuntimeError("injected scheduler fault")

        # Fault injection: the next step fails inside the loop.
        scheduler.schedule = broken_schedule  # type: ignore[method-assign,assignment]
        failed = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert failed.status_code == 500
        assert "failed" in failed.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 503
        refused = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert refused.status_code == 503
