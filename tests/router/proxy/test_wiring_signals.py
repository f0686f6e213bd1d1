"""What the proxy learns of a worker's wiring from its ordinary traffic: token counts
that differ from the engine's (warned about, counted, judged), and predicted hits that
no index entry vouched for."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from router.routing.accuracy import UNVOUCHED_AFTER_HITS
from router.routing.token_agreement import MIN_SAMPLES
from tests.core.test_tokenizer import write_word_tokenizer
from tests.router.proxy.conftest import ADMIN_TOKEN, routed_fleet
from tests.waiting import wait_until

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


async def test_a_router_that_tokenises_otherwise_warns_naming_the_worker_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_word_tokenizer(tmp_path, chat_template=None)
    async with routed_fleet(1, sim_options={"tokenizer": tmp_path}) as fleet:
        async with fleet.openai() as client:
            for turn in range(MIN_SAMPLES):
                with caplog.at_level(logging.WARNING, logger="router.proxy.service"):
                    await client.completions.create(
                        model="kvplane-tiny", prompt=f"hello world {turn} " * 12, max_tokens=1
                    )
        metrics = fleet.router.metrics.render().decode()
    warnings = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert len(warnings) == 1  # once, when the worker crossed the line; not per request
    assert "worker-1 (model kvplane-tiny)" in warnings[0]
    assert "hello" not in warnings[0]  # counts, never text
    checks = (
        'kvplane_prompt_token_checks_total{model="kvplane-tiny",result="mismatch",'
        f'worker="worker-1"}} {MIN_SAMPLES}.0'
    )
    assert checks in metrics


async def test_hits_only_the_routers_own_predictions_foresaw_flag_the_worker() -> None:
    # The engine publishes nothing (every batch dropped): whatever the router predicts
    # there comes from its own predicted entries, and the engine's hits bear them out.
    async with routed_fleet(1, sim_options={"drop_event_fraction": 1.0}) as fleet:
        async with fleet.openai() as client:
            for _ in range(UNVOUCHED_AFTER_HITS + 1):
                await client.completions.create(
                    model="kvplane-tiny", prompt="A shared preamble. " * 20, max_tokens=1
                )
        metrics = fleet.router.metrics.render().decode()
        async with fleet.http() as http:
            answer = (await http.get("/fleet/workers", headers=ADMIN)).json()
    predicted = _value(metrics, "kvplane_predicted_cached_tokens_total")
    assert predicted > 0
    assert _value(metrics, "kvplane_self_predicted_cached_tokens_total") == predicted
    (row,) = answer["workers"]
    vouching = next(c for c in row["wiring"]["checks"] if c["name"] == "index_vouches")
    assert vouching["status"] == "fail"
    assert row["wiring"]["blind"]
    assert answer["routing"] == [
        {"model": "kvplane-tiny", "routing": "predictions_only", "legs": "whole"}
    ]


def _value(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name + "{"))
    return float(line.split()[-1])


@pytest.mark.slow
async def test_the_engines_cap_returns_when_the_miscounting_engine_leaves(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path, chat_template=None)
    long_query = {"model": "kvplane-tiny", "token_ids": list(range(5, 605))}  # 600 tokens

    async def capped(http: httpx.AsyncClient) -> bool:
        answer = await http.post("/fleet/locality", json=long_query, headers=ADMIN)
        assert answer.status_code in (200, 400), answer.text
        return answer.status_code == 400 and "context length is 512" in answer.text

    async with (
        routed_fleet(
            2,
            sim_options={"max_model_len": 512},
            worker_sim_options={"worker-2": {"tokenizer": tmp_path}},
        ) as fleet,
        fleet.http() as http,
    ):
        assert await capped(http)
        await http.post("/fleet/workers/worker-1/drain", headers=ADMIN)
        async with fleet.openai() as client:
            for turn in range(MIN_SAMPLES):
                await client.completions.create(
                    model="kvplane-tiny", prompt=f"hello world {turn} " * 12, max_tokens=1
                )
        await http.post("/fleet/workers/worker-1/undrain", headers=ADMIN)
        # worker-2 counts otherwise: the router's counts are held against no engine's.
        assert not await capped(http)
        await fleet.worker("worker-2").stop_agent()
        await wait_until("the engines' cap is back", lambda: capped(http), timeout_s=15)
