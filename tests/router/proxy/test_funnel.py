"""The cache-loss funnel against the engines' own counters: a fleet serves a workload
with known reuse (a shared system prompt, conversations that grow), and every figure the
router reports, in its metrics and its fleet API, is checked against what the engine
simulators counted themselves; and what a fleet evicted, or copied, is named so."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.abuse.conftest import auth, block_keys, cache_and_wait
from tests.router.proxy.conftest import ADMIN, MODEL, RoutedFleet, routed_fleet, router_settings
from tests.waiting import wait_until

SYSTEM = "You are the support desk of a storage company; answer in two sentences. " * 6


def total(text: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def engines_counted(fleet: RoutedFleet, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        texts = [(await client.get(w.base_url + "/metrics")).text for w in fleet.workers]
    return sum(total(text, name) for text in texts)


async def funnel_row(fleet: RoutedFleet) -> dict[str, Any]:
    async with fleet.http() as http:
        (row,) = (await http.get("/fleet/funnel", headers=ADMIN)).json()["rows"]
    assert isinstance(row, dict)
    return row


async def completed(fleet: RoutedFleet, prompt: str) -> str:
    """The worker that answered `prompt`."""
    async with fleet.openai() as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=1
        )
    return raw.headers["x-kvplane-worker"]


async def test_the_funnel_matches_the_engines_counters() -> None:
    options = {"enable_prompt_tokens_details": True, "num_gpu_blocks_override": 1024}
    async with routed_fleet(2, sim_options=options) as fleet:
        for user in range(3):
            history = SYSTEM
            for turn in range(3):  # each turn extends the last: its prefix is cached
                history += f"User {user} asks question {turn} about their volumes. " * 3
                await cache_and_wait(fleet, history)
        async with fleet.http() as http:
            metrics = (await http.get("/metrics", headers=ADMIN)).text
            (row,) = (await http.get("/fleet/funnel", headers=ADMIN)).json()["rows"]
            hot = await http.get("/fleet/prefixes", headers=ADMIN, params={"limit": 50})
        prompt_tokens = await engines_counted(fleet, "vllm:prompt_tokens_total")
        cached_tokens = await engines_counted(fleet, "vllm:prompt_tokens_cached_total")

    assert (row["model"], row["tenant"], row["requests"]) == (MODEL, "acme", 9)
    stages = {
        stage: total(
            metrics, "kvplane_funnel_tokens_total", model=MODEL, tenant="acme", stage=stage
        )
        for stage in ("prompt", "attainable", "predicted", "achieved")
    }
    assert stages == {
        "prompt": row["prompt_tokens"],
        "attainable": row["attainable_tokens"],
        "predicted": row["predicted_tokens"],
        "achieved": row["achieved_tokens"],
    }
    # The router's prompt tokens are the engines'; its achieved tokens are what the
    # engines counted as served from their caches.
    assert row["prompt_tokens"] == prompt_tokens
    assert row["achieved_tokens"] == cached_tokens
    assert cached_tokens > 0  # the workload's reuse was really there
    assert row["prompt_tokens"] >= row["attainable_tokens"] >= row["predicted_tokens"]
    assert row["predicted_tokens"] >= row["achieved_tokens"]
    # Every block was indexed before the next turn: each prediction held, to the block.
    lost = row["lost_tokens"]
    assert lost["prediction_wrong"] == lost["evicted_before_arrival"] == 0
    assert lost["tier_restore"] == 0
    assert row["attainable_tokens"] - row["predicted_tokens"] == (
        lost["routed_for_load"] + lost["holder_unavailable"]
    )
    # The copies are those passed-over tokens; a cache this size evicted nothing.
    assert row["copied_tokens"] == lost["routed_for_load"] + lost["holder_unavailable"]
    copied = total(metrics, "kvplane_funnel_copied_tokens_total", tenant="acme")
    assert copied == row["copied_tokens"]
    assert lost["evicted_from_fleet"] == 0
    assert row["hit_rate"] == round(row["achieved_tokens"] / row["reported_prompt_tokens"], 4)
    reported = total(metrics, "kvplane_funnel_reported_prompt_tokens_total", tenant="acme")
    assert reported == row["reported_prompt_tokens"]

    # The prefixes reused, heaviest first, as hashes and lengths: every request but the
    # first matched one (a later turn its own history, a new user the system prompt).
    prefixes = hot.json()
    assert sum(prefix["requests"] for prefix in prefixes) == 8
    assert all(prefix["tenant"] == "acme" for prefix in prefixes)
    assert all(len(prefix["key"]) == 16 and prefix["tokens"] % 16 == 0 for prefix in prefixes)
    weights = [prefix["reused_tokens"] for prefix in prefixes]
    assert weights == sorted(weights, reverse=True)
    assert "storage company" not in hot.text


async def test_a_worker_that_left_leaves_no_series_behind() -> None:
    """Per-worker series last while the worker is in the fleet, so that the worker
    label's values stay bounded however many pods come and go; the others' stay."""
    async with routed_fleet(2, router_settings(lease_s=1.0)) as fleet, fleet.http() as http:

        async def served_by(worker: str, other: str) -> None:
            """Four requests, the other worker drained meanwhile."""
            await http.post(f"/fleet/workers/{other}/drain", headers=ADMIN)
            async with fleet.openai() as client:
                for number in range(4):
                    raw = await client.completions.with_raw_response.create(
                        model=MODEL, prompt=f"Question {number}: " + SYSTEM, max_tokens=1
                    )
                    assert raw.headers["x-kvplane-worker"] == worker
            await http.post(f"/fleet/workers/{other}/undrain", headers=ADMIN)

        await served_by("worker-1", "worker-2")
        await served_by("worker-2", "worker-1")
        not_json = await http.post("/v1/completions", content=b"{", headers=auth("acme"))
        assert not_json.status_code == 400  # counted with no worker
        metrics = (await http.get("/metrics", headers=ADMIN)).text
        assert 'worker="worker-1"' in metrics
        await fleet.worker("worker-1").stop_agent()

        async def forgotten() -> bool:
            metrics = (await http.get("/metrics", headers=ADMIN)).text
            return 'worker="worker-1"' not in metrics

        await wait_until("worker-1's series are gone", forgotten, timeout_s=15)
        metrics = (await http.get("/metrics", headers=ADMIN)).text
        workers = (await http.get("/fleet/workers", headers=ADMIN)).json()["workers"]
    assert [w["worker_id"] for w in workers] == ["worker-2"]
    assert total(metrics, "kvplane_requests_total", worker="worker-2", outcome="ok") == 4
    assert total(metrics, "kvplane_requests_total", worker="none", outcome="bad_request") == 1
    # What names no worker stays: the model's and tenant's funnel.
    assert total(metrics, "kvplane_funnel_tokens_total", stage="prompt") > 0


async def test_a_prefix_the_fleet_evicted_is_lost_to_eviction() -> None:
    """One engine with a cache of 16 blocks: other prompts push a conversation's blocks
    out, and when it comes back, the funnel says the fleet held them and evicted them,
    not that it never held them."""
    options = {"enable_prompt_tokens_details": True, "num_gpu_blocks_override": 16}
    first = SYSTEM[:300]
    async with routed_fleet(1, sim_options=options) as fleet:
        await cache_and_wait(fleet, first)
        held = block_keys(fleet.router, first, "acme")

        async def evicted() -> bool:
            return not await fleet.router.index.lookup(held[:1])

        for filler in range(8):
            if await evicted():
                break
            await completed(fleet, f"Filler {filler}: list the shelves of aisle {filler}. " * 6)
        await wait_until("the conversation's first block is evicted", evicted)
        before = await funnel_row(fleet)
        await completed(fleet, first + " And the next question, please.")
        after = await funnel_row(fleet)
        async with fleet.http() as http:
            metrics = (await http.get("/metrics", headers=ADMIN)).text
            (worker,) = (await http.get("/fleet/workers", headers=ADMIN)).json()["workers"]

    def evicted_from_fleet(row: dict[str, Any]) -> int:
        return int(row["lost_tokens"]["evicted_from_fleet"])

    # Nothing evicted was asked for before; then every block the engine had held of the
    # prompt was (an engine evicts a sequence's tail before its head), and nothing past.
    assert evicted_from_fleet(before) == 0
    assert evicted_from_fleet(after) == len(held) * 16 > 0
    assert after["attainable_tokens"] == before["attainable_tokens"]
    assert after["achieved_tokens"] == before["achieved_tokens"]  # really not cached
    reason = "evicted_from_fleet"
    lost = total(metrics, "kvplane_funnel_lost_tokens_total", reason=reason)
    assert lost == worker["cache"]["evicted_from_fleet_tokens"] == evicted_from_fleet(after)


async def test_a_prefix_prefilled_beside_its_holder_is_a_copy() -> None:
    """A prompt's prefix cached on a worker whose engine takes short prompts only: the
    prompt grown past that length goes to the other worker, which prefills the prefix a
    second time, and the funnel counts it copied."""
    short = {"worker-1": {"max_model_len": 160}}
    options = {"enable_prompt_tokens_details": True}
    first = SYSTEM[:200]
    async with (
        routed_fleet(2, sim_options=options, worker_sim_options=short) as fleet,
        fleet.http() as http,
    ):
        await http.post("/fleet/workers/worker-2/drain", headers=ADMIN)
        assert await cache_and_wait(fleet, first) == "worker-1"
        await http.post("/fleet/workers/worker-2/undrain", headers=ADMIN)
        assert await completed(fleet, first + " Which shelf holds box 12?" * 8) == "worker-2"
        row = await funnel_row(fleet)
        metrics = (await http.get("/metrics", headers=ADMIN)).text
        workers = (await http.get("/fleet/workers", headers=ADMIN)).json()["workers"]

    held = len(block_keys(fleet.router, first, "acme")) * 16
    assert held > 0
    assert row["lost_tokens"]["holder_unavailable"] == row["copied_tokens"] == held
    assert total(metrics, "kvplane_funnel_copied_tokens_total", tenant="acme") == held
    copies = {w["worker_id"]: w["cache"]["copied_tokens"] for w in workers}
    assert copies == {"worker-1": 0, "worker-2": held}
