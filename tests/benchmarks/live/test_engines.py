"""The bake-off's engines as real processes: counters survive a restart (the report
reads them after it), and a request's cache salt shows as its blocks' scope (how the
report tells that a router dropped the tenants' salts)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from benchmarks.live.engines import (
    MODEL,
    UNSALTED_SCOPE,
    EngineShape,
    RunningEngines,
    hit_rate,
    parse_totals,
    start_engines,
)
from benchmarks.live.processes import Children
from benchmarks.live.workloads import words


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RunningEngines]:
    children = Children(tmp_path)
    try:
        yield start_engines(children, EngineShape(engines=1, kv_blocks=64))
    finally:
        children.stop_all()


def _chat(fleet: RunningEngines, text: str, cache_salt: str | None = None) -> None:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    httpx2.post(f"{fleet.urls[0]}/v1/chat/completions", json=body, timeout=30).raise_for_status()


def test_counters_are_banked_across_a_restart(fleet: RunningEngines) -> None:
    prompt = words("fleet-test", 200)
    _chat(fleet, prompt)
    _chat(fleet, prompt)  # a hit
    before = fleet.totals()["engine-1"]
    assert before.requests == 2
    assert 0 < before.hit_tokens < before.queried_tokens
    fleet.restart(0)
    _chat(fleet, prompt)  # a miss: the cache went with the restart
    after = fleet.totals()["engine-1"]
    assert after.requests == 3
    assert after.hit_tokens == before.hit_tokens
    assert after.queried_tokens > before.queried_tokens


def test_salted_and_unsalted_blocks_are_told_apart(fleet: RunningEngines) -> None:
    _chat(fleet, words("salted", 100), cache_salt="salt-tenant0")
    scopes = fleet.cache_scopes()
    assert scopes[UNSALTED_SCOPE] == 0
    assert sum(scopes.values()) > 0
    assert fleet.unsalted_blocks() == set()
    _chat(fleet, words("unsalted", 100))
    assert fleet.cache_scopes()[UNSALTED_SCOPE] > 0
    # Each block by engine and hash, so that the ones cached before traffic are told
    # apart from the ones it brought (the bake-off's unsalted_blocks).
    unsalted = fleet.unsalted_blocks()
    assert len(unsalted) == fleet.cache_scopes()[UNSALTED_SCOPE]
    assert {engine for engine, _ in unsalted} == {"engine-1"}


def test_the_fleets_blocks_count_a_copy_once_on_either_tier(tmp_path: Path) -> None:
    children = Children(tmp_path)
    try:
        fleet = start_engines(children, EngineShape(engines=2, kv_blocks=64, cpu_offload_blocks=64))
        prompt = words("copied", 200)
        for url in fleet.urls:  # the same prompt on both engines: a copy
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 2,
            }
            httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=30).raise_for_status()
        # Writes to the CPU tier complete after the step that computed the blocks.
        deadline = time.monotonic() + 10
        blocks = fleet.fleet_blocks()
        while blocks.host_held < blocks.held and time.monotonic() < deadline:
            time.sleep(0.05)
            blocks = fleet.fleet_blocks()
        assert blocks.distinct > 0
        assert blocks.held == 2 * blocks.distinct
        # Offloaded as computed (vLLM's CPU offloading), so both tiers hold the prompt,
        # and a block on the device and in host memory is one distinct block.
        assert blocks.host_held == blocks.held
        assert blocks.host_distinct == blocks.distinct
        assert blocks.distinct_any_tier == blocks.distinct
    finally:
        children.stop_all()


def test_hits_on_a_cpu_tier_count_only_where_asked() -> None:
    text = (
        "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 1000\n"
        "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 300\n"
        "# TYPE vllm:external_prefix_cache_hits counter\n"
        "vllm:external_prefix_cache_hits_total 200\n"
    )
    totals = parse_totals(text)
    assert totals.external_hit_tokens == 200
    assert hit_rate([totals]) == 0.3  # the device's own cache (and P/D's)
    assert hit_rate([totals], external=True) == 0.5  # either tier
