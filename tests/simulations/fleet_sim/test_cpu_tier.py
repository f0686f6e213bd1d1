"""The fleet simulator's CPU tier: the engine simulator's, read back in simulated time,
seen by the simulated router as kvplane's router sees a host tier, and counted as hits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvplane.cli import main
from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier
from router.scoring.policy import Ranking, RoutingPolicy
from router.scoring.score import TIERS, CandidateFacts, RequestFacts
from simulations.engine_sim.timing import TimingModel
from simulations.fleet_sim.policies import RouterPolicy, make_policy
from simulations.fleet_sim.report import figures
from simulations.fleet_sim.requests import TraceRequest, Workload
from simulations.fleet_sim.router_view import RouterView
from simulations.fleet_sim.simulator import FleetConfig, RunRecord, simulate
from simulations.fleet_sim.workloads import shared_prefix

BLOCK = 16
# Steps take no time, so that a request's TTFT is its copies' time alone; a device of 9
# blocks holds one 9-block request, and the next one evicts it.
INSTANT = TimingModel(0.0, 0.0, 0.0, 0.0, 0.0)
ONE_REQUEST = FleetConfig(
    workers=1,
    capacity_tokens=9 * BLOCK,
    timing=INSTANT,
    kv_bytes_per_token=1000,
    kv_offload_bytes_per_s=8 * BLOCK * 1000,  # 8 blocks a second
)


def request(request_id: int, at: float, first: int, last: int | None = None) -> TraceRequest:
    """Eight full blocks from `first` and a partial one of its own (`last`)."""
    blocks = (*range(first, first + 8), request_id + 10_000 if last is None else last)
    return TraceRequest(request_id, at, blocks, 8 * BLOCK + 4, output_tokens=1)


def replay(requests: list[TraceRequest], policy: object, config: FleetConfig) -> RunRecord:
    workload = Workload("test", BLOCK, tuple(requests))
    return simulate(workload, policy, config)  # type: ignore[arg-type]


class ToWorker:
    """Sends each request to the worker its id names (id // 100), and notes what the
    view holds of worker 0 then, and the removals it hears."""

    name = "probe"

    def __init__(self, watched: tuple[int, ...]) -> None:
        self.watched = watched
        self.seen: dict[int, tuple[tuple[int, int], set[int]]] = {}
        self.removals: list[tuple[Tier, list[int]]] = []

    def choose(self, trace: TraceRequest, view: RouterView, now: float) -> int:
        self.seen[trace.request_id] = (
            view.matched_by_tier(0, self.watched),
            set(view.host_cached[0]),
        )
        return trace.request_id // 100

    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        if removed:
            self.removals.append((tier, removed))


def test_a_prefix_the_device_evicted_is_read_back_from_the_cpu_tier() -> None:
    first, other, again = request(1, 0.0, 1), request(2, 10.0, 101), request(3, 20.0, 1)
    config = dataclasses.replace(ONE_REQUEST, cpu_offload_blocks=16)
    policy = make_policy("round-robin", seed=0, block_tokens=BLOCK)
    record = replay([first, other, again], policy, config)
    outcome = record.outcomes[2]
    assert outcome.cached_tokens == 8 * BLOCK  # what it read back, as vLLM reports it
    # The read, 8 blocks of 16 tokens of 1,000 bytes at 128,000 bytes a second, delays
    # its first token by a second (its step takes no time).
    assert outcome.first_token_s is not None
    assert outcome.first_token_s - outcome.arrival_s == pytest.approx(1.0)
    assert record.external_hits == 8 * BLOCK
    result = figures(record, 1.0, 1.0)
    assert result.engine_hit_rate == pytest.approx(
        (record.cache_hits + record.external_hits) / record.cache_queries, abs=1e-4
    )
    assert result.hit_rate == pytest.approx(8 * BLOCK / (3 * (8 * BLOCK + 4)), abs=1e-4)
    # Without the tier the prefix is gone, and so is the delay.
    plain = replay([first, other, again], policy, ONE_REQUEST).outcomes[2]
    assert plain.cached_tokens == 0
    assert plain.first_token_s == pytest.approx(plain.arrival_s)


def test_a_request_waits_for_blocks_still_being_written() -> None:
    # The first request's writes end at t=1; its twin, sent at 0.5 to the device that
    # still holds the blocks, hits there; another, after the device lost them and
    # before their write ends, waits for the write and then reads them.
    first = request(1, 0.0, 1)
    evicting = request(2, 0.1, 101)
    config = dataclasses.replace(ONE_REQUEST, cpu_offload_blocks=16)
    reader = request(3, 0.2, 1)
    record = replay(
        [first, evicting, reader], make_policy("round-robin", seed=0, block_tokens=BLOCK), config
    )
    outcome = record.outcomes[2]
    assert outcome.cached_tokens == 8 * BLOCK
    assert outcome.first_token_s == pytest.approx(1.0 + 1.0)  # the write's end, then the read


def test_the_router_hears_the_tiers_stores_and_removals_after_the_event_delay() -> None:
    # Worker 0 runs A, B and C, each taking the device's room, B and A together filling
    # the CPU tier's (16 blocks); the probes (worker 1) see what the router knows of
    # worker 0.
    a, b, c = request(0, 0.0, 1), request(1, 10.0, 101), request(2, 20.0, 201)
    config = dataclasses.replace(ONE_REQUEST, workers=2, cpu_offload_blocks=16)
    probes = [
        TraceRequest(100 + n, at, (5000 + n,), 4, output_tokens=1)
        for n, at in enumerate((1.005, 1.02, 10.5, 21.5))
    ]
    policy = ToWorker(watched=a.blocks[:8])
    replay([a, *probes[:2], b, probes[2], c, probes[3]], policy, config)
    a_blocks, b_blocks, c_blocks = (set(r.blocks[:8]) for r in (a, b, c))
    # A's write ends at 1.0; the router has it 10 ms later.
    assert policy.seen[100] == ((8, 0), set())
    assert policy.seen[101] == ((8, 0), a_blocks)
    # The device evicted A for B: the router finds A on the CPU tier alone.
    assert policy.seen[102] == ((0, 8), a_blocks)
    # C's write made room by evicting A, the least recent, from the tier too.
    assert policy.seen[103] == ((0, 0), b_blocks | c_blocks)
    removals = [(tier, sorted(removed)) for tier, removed in policy.removals]
    assert (Tier.DEVICE, sorted(a_blocks)) in removals
    assert (Tier.HOST, sorted(a_blocks)) in removals


def test_the_view_counts_a_prefix_on_both_tiers_as_the_routers_index_does() -> None:
    view = RouterView(1)
    blocks = list(range(10))
    view.events(0, stored=blocks[:3], removed=[], cleared=False)
    view.events(0, stored=blocks[2:6], removed=[], cleared=False, tier=Tier.HOST)
    view.events(0, stored=blocks[7:], removed=[], cleared=False, tier=Tier.HOST)
    # Blocks 0-2 on the device (2 on both counts there), 3-5 on the host, then a gap.
    assert view.matched_by_tier(0, blocks) == (3, 3)
    assert view.matched_blocks(0, blocks) == 3  # the peers' reading: the device only
    view.events(0, stored=[], removed=blocks[2:6], cleared=False, tier=Tier.HOST)
    assert view.matched_by_tier(0, blocks) == (3, 0)


class Spy:
    """A routing policy that notes the facts it is given, and lets `policy` rank."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.weights = policy.weights
        self.facts: list[CandidateFacts] = []

    def rank(
        self, request: RequestFacts, facts: CandidateFacts, rng: np.random.Generator
    ) -> Ranking:
        self.facts.append(facts)
        return self.policy.rank(request, facts, rng)


@pytest.mark.parametrize(("host_bandwidth", "chosen"), [(25e9, 0), (0.0, 1)])
def test_kvplane_credits_a_host_tier_match_by_its_tier(host_bandwidth: float, chosen: int) -> None:
    """Worker 0 holds 8 blocks on its CPU tier, worker 1 five on its device: with the
    tier's credit (a host hit worth 93% of a device hit) 8 blocks outweigh 5; without it
    (`host_bandwidth_bytes_per_s` 0, the bake-off's `kvplane no-tier-credit`) they count
    for nothing."""
    scoring = ScoringSettings(host_bandwidth_bytes_per_s=host_bandwidth)
    policy = make_policy("kvplane", seed=0, block_tokens=BLOCK, scoring=scoring)
    assert isinstance(policy, RouterPolicy)
    spy = Spy(policy.policy)
    policy.policy = spy
    trace = request(1, 0.0, 1)
    view = RouterView(2)
    view.events(0, stored=trace.blocks[:8], removed=[], cleared=False, tier=Tier.HOST)
    view.events(1, stored=trace.blocks[:5], removed=[], cleared=False)
    assert policy.choose(trace, view, 0.0) == chosen
    (facts,) = spy.facts
    host, device = TIERS.index(Tier.HOST), TIERS.index(Tier.DEVICE)
    expected = np.zeros((2, len(TIERS)))
    expected[0, host] = 8 * BLOCK
    expected[1, device] = 5 * BLOCK
    np.testing.assert_array_equal(facts.matched_tokens, expected)


def test_a_prediction_extends_the_device_and_the_servable_limit_cuts_the_host_first() -> None:
    policy = make_policy("kvplane", seed=0, block_tokens=BLOCK)
    assert isinstance(policy, RouterPolicy)
    spy = Spy(policy.policy)
    policy.policy = spy
    # A prompt of exactly 8 blocks: 7 servable (its last token is computed).
    trace = TraceRequest(1, 0.0, tuple(range(1, 9)), 8 * BLOCK, output_tokens=1)
    view = RouterView(1)
    view.events(0, stored=trace.blocks[:2], removed=[], cleared=False)
    view.events(0, stored=trace.blocks[2:], removed=[], cleared=False, tier=Tier.HOST)
    policy.choose(trace, view, 0.0)
    first = spy.facts[-1].matched_tokens[0] / BLOCK
    assert (first[TIERS.index(Tier.DEVICE)], first[TIERS.index(Tier.HOST)]) == (2, 5)
    # The choice is predicted on the device: the next request believes it all there.
    view.events(0, stored=[], removed=trace.blocks[2:], cleared=False, tier=Tier.HOST)
    policy.choose(dataclasses.replace(trace, request_id=2), view, 0.1)
    second = spy.facts[-1].matched_tokens[0] / BLOCK
    assert (second[TIERS.index(Tier.DEVICE)], second[TIERS.index(Tier.HOST)]) == (7, 0)


def test_macro_steps_change_nothing_with_a_cpu_tier() -> None:
    workload = shared_prefix(
        groups=8, prompts_per_group=6, system_tokens=1024, question_tokens=64,
        output_tokens=32, block_tokens=64, rate_per_s=4.0, seed=3,
    )  # fmt: skip
    config = FleetConfig(workers=4, capacity_tokens=4096, cpu_offload_blocks=64)
    stepwise = dataclasses.replace(config, macro_steps=False)
    for name in ("round-robin", "kvplane"):
        fast, slow = (
            simulate(workload, make_policy(name, seed=1, block_tokens=64), fleet)
            for fleet in (config, stepwise)
        )
        assert fast.external_hits > 0 or name == "kvplane"  # round-robin's were read back
        assert fast.external_hits == slow.external_hits
        for a, b in zip(fast.outcomes, slow.outcomes, strict=True):
            assert (a.worker, a.cached_tokens) == (b.worker, b.cached_tokens)
            assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-6)
            assert a.finished_s == pytest.approx(b.finished_s, abs=1e-6)


def test_a_tier_turns_evictions_into_hits_on_the_live_eviction_shape() -> None:
    from simulations.fleet_sim.live_shapes import live_capacity_tokens, live_limits, live_workload

    workload = live_workload("zipf-96", rate_per_s=8, duration_s=10, seed=0)
    plain = FleetConfig(workers=4, capacity_tokens=live_capacity_tokens(), limits=live_limits())
    tiered = dataclasses.replace(plain, cpu_offload_blocks=1024)
    policy = "sglang-cache-aware"  # routes by its own state, never by the engines'
    without = simulate(workload, make_policy(policy, seed=0, block_tokens=BLOCK), plain)
    with_tier = simulate(workload, make_policy(policy, seed=0, block_tokens=BLOCK), tiered)
    assert without.external_hits == 0 < with_tier.external_hits
    assert figures(with_tier, 1.0, 1.0).hit_rate > figures(without, 1.0, 1.0).hit_rate


def test_the_tier_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tier.json"
    code = main(
        ["sim", "--live", "zipf-8", "--workload-arg", "rate_per_s=4", "--workload-arg",
         "duration_s=3", "--policies", "kvplane", "--cpu-offload-blocks", "256",
         "--kv-offload-bytes-per-s", "4e9", "--kv-bytes-per-token", "4096", "--time-scale", "2",
         "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    assert "4 workers of 8,192 tokens and 256 CPU blocks" in capsys.readouterr().out
    run = json.loads(out.read_text())["run"]
    # A slower fleet's copies are slower too.
    assert (run["cpu_offload_blocks"], run["kv_offload_bytes_per_s"]) == (256, 2e9)
    assert run["kv_bytes_per_token"] == 4096
    code = main(
        ["sim", "--live", "zipf-8", "--workload-arg", "duration_s=2", "--policies", "kvplane",
         "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    run = json.loads(out.read_text())["run"]
    # None by default, and the engine simulator's copy model.
    assert (run["cpu_offload_blocks"], run["kv_offload_bytes_per_s"]) == (0, 20e9)
    assert run["kv_bytes_per_token"] == 131_072


@pytest.mark.parametrize(
    "flags", [["--cpu-offload-blocks", "-1"], ["--kv-offload-bytes-per-s", "0"]]
)
def test_a_bad_tier_flag_is_one_clear_line(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "--live", "zipf-8", *flags]) == 2
    error = capsys.readouterr().err
    assert "kvplane sim:" in error
    assert "Traceback" not in error
