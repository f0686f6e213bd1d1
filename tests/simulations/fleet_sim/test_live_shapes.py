"""The live bake-off's shapes in the fleet simulator: the same numbers as
`benchmarks/live` (read from it here, since the simulator does not import it), and the
workloads they make."""

from __future__ import annotations

import inspect
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.live import workloads as live
from benchmarks.live.engines import BLOCK_SIZE, EngineShape
from benchmarks.live.grid import LOADS, PROFILES
from simulations.engine_sim.scheduler import SchedulerLimits
from simulations.fleet_sim import live_shapes
from simulations.fleet_sim.live_shapes import live_workload
from simulations.fleet_sim.policies import POLICIES
from simulations.fleet_sim.workloads import group_drawer


def defaults(function: Any) -> dict[str, Any]:
    return {
        name: parameter.default
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def test_the_fleet_is_the_live_one() -> None:
    shape = EngineShape()
    assert shape.engines == live_shapes.LIVE_ENGINES
    assert shape.kv_blocks == live_shapes.LIVE_KV_BLOCKS
    assert shape.max_num_seqs == live_shapes.LIVE_MAX_NUM_SEQS
    assert live_shapes.LIVE_BLOCK_TOKENS == BLOCK_SIZE
    assert live_shapes.live_capacity_tokens() == shape.kv_blocks * BLOCK_SIZE
    # The engines' other scheduling limit is the engine simulator's default in both.
    assert live_shapes.live_limits() == SchedulerLimits(max_num_seqs=shape.max_num_seqs)
    assert live_shapes.LIVE_LOADS == LOADS
    assert PROFILES["default"].duration_s == live_shapes.LIVE_DURATION_S


@pytest.mark.parametrize(
    ("live_generator", "live_names", "simulated"),
    [
        (
            live.shared_prompts,
            {"system_tokens": "system_tokens", "question_tokens": "question_tokens",
             "output_tokens": "max_tokens"},
            live_shapes.SHARED_DEFAULTS,
        ),
        (
            live.multi_turn,
            {"turns": "turns", "system_tokens": "system_tokens", "turn_tokens": "user_tokens",
             "output_tokens": "max_tokens", "think_time_s": "think_s"},
            live_shapes.MULTI_TURN_DEFAULTS,
        ),
        (
            live.agent_tree,
            {"trunk_tokens": "trunk_tokens", "step_tokens": "step_tokens",
             "branches": "branches", "depth": "depth", "output_tokens": "max_tokens",
             "step_time_s": "step_s"},
            live_shapes.AGENT_TREE_DEFAULTS,
        ),
    ],
)  # fmt: skip
def test_the_workloads_parameters_are_the_live_ones(
    live_generator: Callable[..., object], live_names: dict[str, str], simulated: dict[str, Any]
) -> None:
    """Each simulated default equals the bake-off's parameter of the same meaning (named
    `live_names[ours]` there)."""
    live_defaults = defaults(live_generator)
    assert {ours: live_defaults[theirs] for ours, theirs in live_names.items()} == simulated


def test_shared_n_draws_one_of_n_system_prompts_per_request() -> None:
    workload = live_workload("shared-8", rate_per_s=15.0, duration_s=15.0, seed=1)
    assert workload.name == "live/shared-8"
    assert workload.block_tokens == 16
    requests = workload.requests
    # As many requests as the live run's Poisson schedule would send (same rate, span).
    live_count = live.shared_prompts(15.0, 15.0, groups=8, seed=1).requests
    assert len(requests) == pytest.approx(live_count, rel=0.2)
    assert {r.prompt_tokens for r in requests} == {2048 + 128}
    assert {r.output_tokens for r in requests} == {16}
    assert len(Counter(r.blocks[:128] for r in requests)) == 8
    assert not workload.closed_loop


def test_zipf_n_is_the_live_zipf_workload() -> None:
    assert live_shapes.ZIPF_DEFAULTS == {
        **live_shapes.SHARED_DEFAULTS,
        "system_tokens": live.ZIPF_SYSTEM_TOKENS,
        "popularity": live.ZIPF_EXPONENT,
    }
    requests = live_workload("zipf-96", rate_per_s=15.0, duration_s=60.0).requests
    assert {r.prompt_tokens for r in requests} == {1024 + 128}
    systems = Counter(r.blocks[:64] for r in requests)
    assert 0.13 < max(systems.values()) / len(requests) < 0.26  # 1 / H(96) of the draws
    assert len(systems) > 48


def test_group_drawer_is_uniform_at_popularity_zero_and_refuses_a_negative_one() -> None:
    rng = random.Random(3)
    draw = group_drawer(rng, 4, 0.0)
    assert Counter(draw() for _ in range(4000)).keys() == {0, 1, 2, 3}
    assert [group_drawer(random.Random(5), 9, 0.0)() for _ in range(1)] == [
        random.Random(5).randrange(9)
    ]
    with pytest.raises(ValueError, match="popularity"):
        group_drawer(rng, 4, -1.0)


def test_multi_turn_is_closed_loop_and_its_rate_counts_requests() -> None:
    workload = live_workload("multi-turn", rate_per_s=15.0, duration_s=40.0)
    requests = workload.requests
    assert workload.closed_loop
    firsts = [r for r in requests if r.follows is None]
    # Chats start at 15 / 5 = 3 per second; each has 5 turns.
    assert len(firsts) == pytest.approx(3.0 * 40.0, rel=0.2)
    assert len(requests) == 5 * len(firsts)
    assert {r.output_tokens for r in requests} == {24}
    assert min(r.prompt_tokens for r in requests) == 1024 + 128
    assert max(r.prompt_tokens for r in requests) == 1024 + 5 * 128 + 4 * 24
    follower = next(r for r in requests if r.follows is not None)
    assert follower.after_s > 0


def test_agent_trees_are_closed_loop_and_their_rate_counts_requests() -> None:
    workload = live_workload("agent-tree", rate_per_s=13.0, duration_s=40.0, seed=2)
    requests = workload.requests
    assert workload.closed_loop
    trunks = [r for r in requests if r.follows is None]
    # Trees start at 13 / 13 = 1 a second; each has 1 + 3 + 9 requests.
    assert len(trunks) == 40
    assert len(requests) == 13 * len(trunks)
    assert {r.prompt_tokens for r in trunks} == {2048}
    by_id = {r.request_id: r for r in requests}
    for request in requests:
        if request.follows is None:
            continue
        parent = by_id[request.follows]
        # A step is its parent's prompt, the parent's answer and its own new tokens,
        # sent a step time after the parent's response ends.
        assert request.prompt_tokens == parent.prompt_tokens + 24 + 64
        whole = parent.prompt_tokens // workload.block_tokens  # the parent's whole blocks
        assert request.blocks[:whole] == parent.blocks[:whole]
        assert request.after_s > 0
    depths = Counter(r.prompt_tokens for r in requests)
    assert depths == {2048: 40, 2048 + 88: 120, 2048 + 2 * 88: 360}
    # The live workload sends as many in the same span, on average.
    live_requests = sum(13 for _ in live.agent_tree(13.0, 40.0, seed=2).conversations)
    assert len(requests) == pytest.approx(live_requests, rel=0.35)


def test_overrides_and_unknown_names() -> None:
    workload = live_workload("shared-2", rate_per_s=5.0, duration_s=4.0, output_tokens=4)
    assert {r.output_tokens for r in workload.requests} == {4}
    for name in ("shared-x", "agent-trees"):
        with pytest.raises(ValueError, match="unknown live workload"):
            live_workload(name)
    with pytest.raises(ValueError, match="positive"):
        live_workload("shared-2", rate_per_s=0.0)


@pytest.mark.parametrize(
    ("name", "argument"),
    [
        ("shared-2", "block_tokens"),  # the bake-off's block size, set by every shape
        ("shared-2", "groups"),  # the name's
        ("multi-turn", "closed_loop"),  # turns follow their answers, as live
        ("agent-tree", "trees"),  # from the rate and the duration
        ("multi-turn", "no_such_parameter"),
    ],
)
def test_an_override_the_shape_does_not_take_is_named(name: str, argument: str) -> None:
    # It used to reach the generator as a second value, or as an unknown keyword, and
    # come out as Python's TypeError about a function the user never called.
    with pytest.raises(ValueError, match=f"live workload '{name}': cannot set {argument} "):
        live_workload(name, **{argument: 1})


def test_the_live_router_overheads_name_simulated_policies() -> None:
    assert set(live_shapes.LIVE_ROUTER_OVERHEAD_MS) <= set(POLICIES)
    # kvplane's Python proxy costs more than the Rust peers (bench live's CPU ms/req).
    overheads = live_shapes.LIVE_ROUTER_OVERHEAD_MS
    assert overheads["kvplane"] == overheads["round-robin"] > overheads["sglang-cache-aware"]
