"""The live bake-off's shapes for the fleet simulator (`kvplane sim --live NAME`), so
that the simulator's ranking of routers can be set against `kvplane bench live`'s.

The fleet of `benchmarks/live/engines.py` (`EngineShape`): 4 engines of 512 KV blocks of
16 tokens, `max_num_seqs` 16, the engine simulator's default timing model and
`max_num_batched_tokens`. The workloads of `benchmarks/live/workloads.py`, built with
this package's generators:

- `shared-N`: N system prompts of 2,048 tokens, each request one of them (drawn at
  random) and its own 128-token question, 16 output tokens, Poisson arrivals at
  `rate_per_s` for `duration_s` (`shared_prefix` with `duration_s`).
- `zipf-N`: the same with N system prompts of 1,024 tokens drawn by a Zipf law of
  exponent 1 (`ZIPF_DEFAULTS`): the `eviction` situation's `zipf-96`.
- `multi-turn`: 5-turn chats sharing one 1,024-token system prompt, 128-token turns,
  24 output tokens; chats start at `rate_per_s / turns` (the rate counts requests) for
  `duration_s`, each turn sent an exponential think time (mean 1 s) after the previous
  turn's response ends (`multi_turn` with `closed_loop`).
- `agent-tree`: trees of a 2,048-token trunk, 3 branches, depth 2 (13 requests), each
  step its parent's prompt, its 24 output tokens and 64 new tokens, sent an exponential
  step time (mean 0.2 s) after its parent's response ends; trees start at
  `rate_per_s / 13` (the rate counts requests), as many as start in `duration_s` on
  average (`agent_tree` with `closed_loop`).

The live workloads are text, about 2.5 tokens a word with kvplane's tiny tokenizer;
here lengths are exact token counts. The live system prompts of `shared-N` begin with
"You are assistant N." and chat templates add a few tokens per message: neither changes
which requests share a prefix. The values are kept equal to the live ones by a test
(`tests/simulations/fleet_sim/test_live_shapes.py`), since the simulator does not import the
benchmark.

`LIVE_LOADS` are the bake-off's loads by name; `--sweep rate_per_s=5,15,30` runs them
all. `LIVE_ROUTER_OVERHEAD_MS` (`--live-router-overheads`) is what each router cost a
request in the bake-off on its 2-core machine (its "CPU ms/req" column: kvplane's
Python proxy and agents 20-30 ms, the Rust peers 3-7 ms), taken as latency before the
engine has the request; kvplane's round-robin runs in kvplane's proxy.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from simulations.engine_sim.scheduler import SchedulerLimits
from simulations.fleet_sim.requests import Workload
from simulations.fleet_sim.workloads import agent_tree, multi_turn, shared_prefix

LIVE_ENGINES = 4
LIVE_KV_BLOCKS = 512
LIVE_BLOCK_TOKENS = 16
LIVE_MAX_NUM_SEQS = 16
LIVE_LOADS: dict[str, float] = {"light": 5.0, "moderate": 8.0, "medium": 15.0, "heavy": 30.0}
LIVE_DURATION_S = 15.0  # the bake-off's default profile

LIVE_ROUTER_OVERHEAD_MS: dict[str, float] = {
    "kvplane": 25.0,
    "round-robin": 25.0,
    "sglang-cache-aware": 5.0,
    "vllm-router-cache-aware": 5.0,
}

SHARED_DEFAULTS: dict[str, Any] = {
    "system_tokens": 2048,
    "question_tokens": 128,
    "output_tokens": 16,
}
ZIPF_DEFAULTS: dict[str, Any] = {**SHARED_DEFAULTS, "system_tokens": 1024, "popularity": 1.0}
MULTI_TURN_DEFAULTS: dict[str, Any] = {
    "turns": 5,
    "system_tokens": 1024,
    "turn_tokens": 128,
    "output_tokens": 24,
    "think_time_s": 1.0,
}

AGENT_TREE_DEFAULTS: dict[str, Any] = {
    "trunk_tokens": 2048,
    "step_tokens": 64,
    "branches": 3,
    "depth": 2,
    "output_tokens": 24,
    "step_time_s": 0.2,
}
_NAMES = "shared-N, zipf-N, multi-turn, agent-tree"


def live_capacity_tokens() -> int:
    """KV cache per engine, in tokens."""
    return LIVE_KV_BLOCKS * LIVE_BLOCK_TOKENS


def live_limits() -> SchedulerLimits:
    return SchedulerLimits(max_num_seqs=LIVE_MAX_NUM_SEQS)


def live_workload(
    name: str,
    *,
    rate_per_s: float = LIVE_LOADS["medium"],
    duration_s: float = LIVE_DURATION_S,
    seed: int = 0,
    **overrides: Any,
) -> Workload:
    """The bake-off's workload `name` (`shared-N`, `zipf-N`, `multi-turn`, `agent-tree`) at
    `rate_per_s` requests per second for `duration_s` seconds; `overrides` change any
    parameter of the generator (e.g. `output_tokens`)."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate_per_s and duration_s must be positive")
    if name.startswith(("shared-", "zipf-")):
        kind, _, count = name.partition("-")
        try:
            groups = int(count)
        except ValueError:
            raise ValueError(f"unknown live workload {name!r} ({_NAMES})") from None
        _check_overrides(name, shared_prefix, overrides, fixed={"groups", *_ALWAYS_FIXED})
        defaults = ZIPF_DEFAULTS if kind == "zipf" else SHARED_DEFAULTS
        params = {**defaults, "groups": groups, **overrides}
        workload = shared_prefix(
            **params,
            block_tokens=LIVE_BLOCK_TOKENS,
            rate_per_s=rate_per_s,
            duration_s=duration_s,
            seed=seed,
        )
    elif name == "multi-turn":
        _check_overrides(name, multi_turn, overrides, fixed={"closed_loop", *_ALWAYS_FIXED})
        params = {**MULTI_TURN_DEFAULTS, **overrides}
        workload = multi_turn(
            **params,
            block_tokens=LIVE_BLOCK_TOKENS,
            rate_per_s=rate_per_s / params["turns"],
            duration_s=duration_s,
            closed_loop=True,
            seed=seed,
        )
    elif name == "agent-tree":
        fixed = {"trees", "closed_loop", *_ALWAYS_FIXED}
        _check_overrides(name, agent_tree, overrides, fixed=fixed)
        params = {**AGENT_TREE_DEFAULTS, **overrides}
        per_tree = sum(params["branches"] ** level for level in range(params["depth"] + 1))
        tree_rate = rate_per_s / per_tree
        workload = agent_tree(
            **params,
            trees=max(1, round(tree_rate * duration_s)),
            rate_per_s=tree_rate,
            block_tokens=LIVE_BLOCK_TOKENS,
            closed_loop=True,
            seed=seed,
        )
    else:
        raise ValueError(f"unknown live workload {name!r} ({_NAMES})")
    return dataclasses.replace(workload, name=f"live/{name}")


# What every live shape sets itself: the bake-off's block size, and the arrivals that
# live_workload's own arguments give.
_ALWAYS_FIXED = frozenset({"block_tokens", "rate_per_s", "duration_s", "seed"})


def _check_overrides(
    name: str, generator: Callable[..., Workload], overrides: Mapping[str, Any], fixed: set[str]
) -> None:
    """ValueError naming the `overrides` that `generator` does not take, or that the
    live shape `name` sets itself (`fixed`)."""
    taken = set(inspect.signature(generator).parameters) - fixed
    refused = sorted(set(overrides) - taken)
    if refused:
        raise ValueError(
            f"live workload {name!r}: cannot set {', '.join(refused)} "
            f"(it takes {', '.join(sorted(taken))})"
        )
