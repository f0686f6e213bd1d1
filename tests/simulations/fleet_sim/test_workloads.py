"""Fleet-simulator workloads: the trace loaders (small files, real traces), generators' shapes."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from simulations.fleet_sim.requests import Workload
from simulations.fleet_sim.workloads import (
    WORKLOADS,
    PrefixChain,
    agent_tree,
    llmd_prefix,
    load_azure,
    load_mooncake,
    load_trace,
    multi_tenant,
    multi_turn,
    poisson_arrivals,
    ramp_arrivals,
    shared_prefix,
)

TRACES = Path(__file__).resolve().parents[3] / "simulations" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
AZURE_CODE = TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv"


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_invariants(workload: Workload) -> None:
    """What every workload promises: numbered by arrival, one id per (partial) block."""
    size = workload.block_tokens
    for i, request in enumerate(workload.requests):
        assert request.request_id == i
        assert len(request.blocks) == math.ceil(request.prompt_tokens / size)
        assert request.output_tokens >= 1
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals)
    assert all(t >= 0 for t in arrivals)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Mooncake ----------------------------------------------------------------------------


def test_mooncake_loader_on_a_small_file(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [0]},
            {"timestamp": 3000, "input_length": 1025, "output_length": 7, "hash_ids": [0, 1, 2]},
        ],
    )
    workload = load_mooncake(path)
    check_invariants(workload)
    assert workload.block_tokens == 512
    assert [r.arrival_s for r in workload.requests] == [0.0, 1.5, 3.0]
    assert [r.blocks for r in workload.requests] == [(0, 1), (0,), (0, 1, 2)]
    assert [r.prompt_tokens for r in workload.requests] == [600, 512, 1025]
    assert [r.output_tokens for r in workload.requests] == [5, 1, 7]  # at least one

    fast = load_mooncake(path, speedup=2.0, limit=2)
    assert [r.arrival_s for r in fast.requests] == [0.0, 0.75]
    assert load_trace(path) == workload


@pytest.mark.parametrize(
    "bad",
    [
        {"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [0]},
        {"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 9, "input_length": 600, "output_length": 5},
        {"timestamp": 9, "input_length": "secret", "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 9, "input_length": 0, "output_length": 5, "hash_ids": []},
    ],
)
def test_mooncake_loader_rejects_bad_lines_by_number(tmp_path: Path, bad: dict[str, Any]) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}
    path = write_jsonl(tmp_path / "t.jsonl", [good, bad])
    with pytest.raises(ValueError, match="line 2") as raised:
        load_mooncake(path)
    assert "secret" not in str(raised.value)


def test_mooncake_loader_rejects_invalid_json_without_quoting_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hush": "private words"\n')
    with pytest.raises(ValueError, match="line 1") as raised:
        load_mooncake(path)
    assert "private" not in str(raised.value)


def test_real_mooncake_trace_head() -> None:
    workload = load_mooncake(MOONCAKE, limit=2000)
    check_invariants(workload)
    assert len(workload.requests) == 2000
    assert workload.block_tokens == 512
    assert all(r.blocks[0] == 0 for r in workload.requests)  # the shared system prompt
    assert workload.requests[0].blocks == tuple(range(14))
    assert workload.requests[0].prompt_tokens == 6758
    assert 0 < workload.duration_s < 3537


def test_real_mooncake_trace_whole() -> None:
    workload = load_trace(MOONCAKE)
    check_invariants(workload)
    assert len(workload.requests) == 12031
    assert workload.duration_s == pytest.approx(3537, abs=1)
    mean_input = sum(r.prompt_tokens for r in workload.requests) / 12031
    assert mean_input == pytest.approx(12035, abs=1)
    assert load_mooncake(MOONCAKE, speedup=10).duration_s == pytest.approx(353.7, abs=0.1)


# Azure -------------------------------------------------------------------------------


def test_azure_loader_on_a_small_file(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,40,10\n"
        "2023-11-16 18:17:05.4799600,16,0\n"
        "2023-11-16 18:17:13.9799600,17,3\n"
    )
    workload = load_azure(path)
    check_invariants(workload)
    assert [r.arrival_s for r in workload.requests] == pytest.approx([0.0, 1.5, 10.0])
    assert [r.prompt_tokens for r in workload.requests] == [40, 16, 17]
    assert [r.output_tokens for r in workload.requests] == [10, 1, 3]
    assert [len(r.blocks) for r in workload.requests] == [3, 1, 2]
    ids = [b for r in workload.requests for b in r.blocks]
    assert len(ids) == len(set(ids))  # nothing shared
    assert load_azure(path, block_tokens=32, speedup=2, limit=2).requests[1].arrival_s == 0.75
    other = load_azure(path, seed=1)
    assert not set(ids) & {b for r in other.requests for b in r.blocks}
    assert load_trace(path) == workload


def test_azure_loader_rejects_bad_rows_by_number(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,40,10\n"
        "2023-11-16 18:17:04.0000000,private,10\n"
    )
    with pytest.raises(ValueError, match="line 3") as raised:
        load_azure(path)
    assert "private" not in str(raised.value)
    path.write_text("when,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="header"):
        load_azure(path)


def test_real_azure_code_trace() -> None:
    workload = load_trace(AZURE_CODE)
    check_invariants(workload)
    assert len(workload.requests) == 8819
    assert workload.duration_s == pytest.approx(3436, abs=1)
    assert sum(r.prompt_tokens for r in workload.requests) / 8819 == pytest.approx(2048, abs=1)
    ids = [b for r in workload.requests for b in r.blocks]
    assert len(ids) == len(set(ids))


def test_load_trace_refuses_unknown_formats(tmp_path: Path) -> None:
    odd = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "prompt": "x"}])
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(odd)
    text = tmp_path / "t.txt"
    text.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(text)


# Chains and arrivals -----------------------------------------------------------------


def test_chains_share_blocks_exactly_as_far_as_their_tokens_agree() -> None:
    start = PrefixChain.start(4)
    a = start.extend("sys", 6).extend("qa", 5)  # tokens 0-5 sys, 6-10 qa
    b = start.extend("sys", 6).extend("qb", 5)
    assert len(a.blocks()) == len(b.blocks()) == 3
    assert common_prefix(a.blocks(), b.blocks()) == 1  # block 1 mixes sys and the question
    assert a.blocks()[:2] == a.extend("more", 1).blocks()[:2]
    assert a.blocks()[2] != a.extend("more", 1).blocks()[2]  # a partial block grew
    assert start.extend("x", 4).extend("y", 4).blocks() != start.extend("x", 8).blocks()
    assert start.extend("x", 2).extend("x", 2).blocks() != start.extend("x", 4).blocks()
    salted = PrefixChain.start(4, salt="t1").extend("sys", 8).blocks()
    assert not set(salted) & set(start.extend("sys", 8).blocks())


def test_poisson_arrivals() -> None:
    times = poisson_arrivals(random.Random(1), 10.0, 5000)
    assert times == sorted(times)
    assert times == poisson_arrivals(random.Random(1), 10.0, 5000)
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.05)


def test_ramp_arrivals_follow_the_rate() -> None:
    times = ramp_arrivals(random.Random(2), 3.0, 60.0, 200.0)
    assert times == sorted(times)
    assert times[0] > 0
    assert times[-1] < 200.0
    assert len(times) == pytest.approx((3 + 60) / 2 * 200, rel=0.05)
    first_half = sum(1 for t in times if t < 100)
    # Expected: 3 * 100 + 57 * 100 / 4 = 1725 in the first half, 4575 in the second.
    assert first_half == pytest.approx(1725, rel=0.1)
    flat = ramp_arrivals(random.Random(2), 5.0, 5.0, 400.0)
    assert len(flat) == pytest.approx(2000, rel=0.08)
    falling = ramp_arrivals(random.Random(2), 60.0, 0.0, 100.0)
    assert sum(1 for t in falling if t < 50) > 2 * sum(1 for t in falling if t >= 50)


# Generators --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_deterministic_and_well_formed(name: str) -> None:
    small: dict[str, dict[str, Any]] = {
        "shared-prefix": {"groups": 4, "prompts_per_group": 3, "rate_per_s": 5.0},
        "llmd-prefix": {"groups": 6, "duration_s": 10.0},
        "multi-turn": {"sessions": 5, "turns": 3},
        "agent-tree": {"trees": 3, "branches": 2, "depth": 2},
        "multi-tenant": {"tenants": 2, "groups_per_tenant": 2, "prompts_per_group": 3},
    }
    make = WORKLOADS[name]
    workload = make(seed=3, **small[name])
    check_invariants(workload)
    assert workload.name == name
    assert workload.requests
    assert make(seed=3, **small[name]) == workload
    assert make(seed=4, **small[name]) != workload
    assert all(isinstance(b, int) and 0 <= b < 2**63 for r in workload.requests for b in r.blocks)


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    workload = shared_prefix()
    check_invariants(workload)
    assert len(workload.requests) == 64 * 16
    assert all(r.arrival_s == 0.0 for r in workload.requests)
    assert {r.prompt_tokens for r in workload.requests} == {2048 + 128}
    assert {r.output_tokens for r in workload.requests} == {256}
    groups: dict[int, list[tuple[int, ...]]] = {}
    for request in workload.requests:
        groups.setdefault(request.blocks[0], []).append(request.blocks)
    assert len(groups) == 64
    assert all(len(members) == 16 for members in groups.values())
    for members in groups.values():
        system = members[0][:32]
        assert all(m[:32] == system for m in members)
        assert all(common_prefix(a, b) == 32 for a in members for b in members if a is not b)
        questions = [m[32:] for m in members]
        assert len({b for q in questions for b in q}) == 16 * 2  # no question block shared
    # Shuffled: consecutive requests are not all from one group.
    firsts = [r.blocks[0] for r in workload.requests[:16]]
    assert len(set(firsts)) > 1


def test_shared_prefix_unaligned_system_prompt_shares_only_full_blocks() -> None:
    workload = shared_prefix(groups=1, prompts_per_group=2, system_tokens=100, question_tokens=30)
    a, b = (r.blocks for r in workload.requests)
    assert len(a) == 3  # 130 tokens of 64
    assert common_prefix(a, b) == 1  # block 1 holds system tokens 64-99 and the question


def test_shared_prefix_with_a_rate_is_poisson() -> None:
    workload = shared_prefix(rate_per_s=50.0)
    assert workload.requests[0].arrival_s > 0
    assert len(workload.requests) / workload.duration_s == pytest.approx(50.0, rel=0.1)


def test_llmd_prefix_users_repeat_their_question() -> None:
    workload = llmd_prefix(duration_s=60.0)
    check_invariants(workload)
    assert len(workload.requests) == pytest.approx(31.5 * 60, rel=0.1)
    assert {r.prompt_tokens for r in workload.requests} == {7200}
    assert {r.output_tokens for r in workload.requests} == {1000}
    prompts = {r.blocks for r in workload.requests}
    assert len(prompts) <= 150 * 5
    assert len(prompts) < len(workload.requests)  # users come back with the same prompt
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for blocks in prompts:
        by_group.setdefault(blocks[0], set()).add(blocks)
    assert len(by_group) <= 150
    assert all(len(users) <= 5 for users in by_group.values())
    for users in by_group.values():
        listed = sorted(users)
        # 6,000 prefix tokens = 93 full blocks of 64; block 93 mixes prefix and question.
        assert all(common_prefix(a, b) == 93 for a in listed for b in listed if a != b)


def test_llmd_prefix_new_question_per_request() -> None:
    workload = llmd_prefix(duration_s=20.0, new_question_per_request=True)
    assert len({r.blocks for r in workload.requests}) == len(workload.requests)
    tails = [b for r in workload.requests for b in r.blocks[93:]]
    assert len(tails) == len(set(tails))


def test_llmd_prefix_rate_ramps_up() -> None:
    workload = llmd_prefix(duration_s=100.0)
    early = sum(1 for r in workload.requests if r.arrival_s < 50)
    late = len(workload.requests) - early
    assert late > 2 * early


def test_multi_turn_prompts_grow_from_the_previous_turn() -> None:
    workload = multi_turn(sessions=20, turns=5, system_tokens=1000, turn_tokens=100)
    check_invariants(workload)
    assert len(workload.requests) == 100
    sessions: dict[int, list[tuple[float, int, tuple[int, ...]]]] = {}
    for r in workload.requests:
        # Block 15 (tokens 960-1023: the system prompt's end, the first turn's start) is
        # full from the first turn on, and the session's own.
        sessions.setdefault(r.blocks[15], []).append((r.arrival_s, r.prompt_tokens, r.blocks))
    assert len(sessions) == 20
    system_blocks = workload.requests[0].blocks[:15]  # 1,000 // 64
    for turns in sessions.values():
        assert [p for _, p, _ in turns] == [1100 + k * (256 + 100) for k in range(5)]
        for (t0, p0, b0), (t1, _, b1) in itertools.pairwise(turns):
            assert t1 > t0
            full = p0 // 64
            assert b1[:full] == b0[:full]
            assert len(b1) > len(b0)
        assert turns[0][2][:15] == system_blocks


def test_agent_tree_branches_from_the_trunk() -> None:
    workload = agent_tree(trees=4, branches=3, depth=2, trunk_tokens=1024, step_tokens=64)
    check_invariants(workload)
    assert len(workload.requests) == 4 * (1 + 3 + 9)
    roots = [r for r in workload.requests if r.prompt_tokens == 1024]
    assert len(roots) == 4
    trunks = {r.blocks for r in roots}
    for request in workload.requests:
        if request in roots:
            continue
        parents = [
            p
            for p in workload.requests
            if p.arrival_s < request.arrival_s
            and request.prompt_tokens == p.prompt_tokens + 128 + 64
            and request.blocks[: p.prompt_tokens // 64] == p.blocks[: p.prompt_tokens // 64]
        ]
        assert len(parents) == 1
        assert sum(1 for t in trunks if request.blocks[:16] == t) == 1
    children = [r for r in workload.requests if r.prompt_tokens == 1024 + 192]
    assert len({r.blocks for r in children}) == 12  # siblings differ in their step


def test_multi_tenant_tenants_never_share_a_block() -> None:
    workload = multi_tenant()
    check_invariants(workload)
    assert len(workload.requests) == 4 * 8 * 32
    blocks_by_tenant: dict[str, set[int]] = {}
    for r in workload.requests:
        blocks_by_tenant.setdefault(r.tenant, set()).update(r.blocks)
    assert sorted(blocks_by_tenant) == [f"tenant-{t}" for t in range(4)]
    tenants = list(blocks_by_tenant.values())
    assert all(not a & b for a in tenants for b in tenants if a is not b)
    # Within a tenant, each group's prompts share its 32 system blocks.
    first = [r for r in workload.requests if r.tenant == "tenant-0"]
    groups = {r.blocks[:32] for r in first}
    assert len(groups) == 8
    assert len(workload.requests) / workload.duration_s == pytest.approx(20.0, rel=0.15)


def test_multi_tenant_same_text_same_shape_different_ids() -> None:
    shared = multi_tenant(tenants=2, groups_per_tenant=1, prompts_per_group=2)
    own = multi_tenant(
        tenants=2, groups_per_tenant=1, prompts_per_group=2, shared_system_text=False
    )
    for workload in (shared, own):
        zero = {b for r in workload.requests if r.tenant == "tenant-0" for b in r.blocks}
        one = {b for r in workload.requests if r.tenant == "tenant-1" for b in r.blocks}
        assert zero
        assert one
        assert not zero & one


def test_shared_prefix_over_a_duration_draws_a_group_per_request() -> None:
    workload = shared_prefix(
        groups=8, system_tokens=2048, question_tokens=128, output_tokens=16, block_tokens=16,
        rate_per_s=20.0, duration_s=30.0, seed=5,
    )  # fmt: skip
    check_invariants(workload)
    requests = workload.requests
    assert len(requests) == pytest.approx(600, rel=0.15)
    assert all(r.arrival_s < 30.0 for r in requests)
    assert {r.prompt_tokens for r in requests} == {2048 + 128}
    # The system prompt's 128 blocks name the group; every request has its own question.
    groups = Counter(r.blocks[:128] for r in requests)
    assert len(groups) == 8
    assert min(groups.values()) > 600 / 8 / 2  # drawn at random, none starved
    assert len({r.blocks[128:] for r in requests}) == len(requests)
    assert all(r.follows is None for r in requests)
    with pytest.raises(ValueError, match="rate_per_s"):
        shared_prefix(groups=2, duration_s=10.0)


def test_shared_prefix_without_a_duration_is_unchanged() -> None:
    # The same prompts in the same order as before duration_s existed: a fixed
    # number per group, shuffled.
    workload = shared_prefix(groups=3, prompts_per_group=4, rate_per_s=2.0, seed=1)
    assert len(workload.requests) == 12
    assert Counter(r.blocks[0] for r in workload.requests).most_common()[0][1] == 4


def test_multi_turn_closed_loop_turns_follow_the_previous_response() -> None:
    open_loop = multi_turn(sessions=6, turns=4, system_tokens=256, turn_tokens=64, seed=2)
    closed = multi_turn(
        sessions=6, turns=4, system_tokens=256, turn_tokens=64, seed=2, closed_loop=True
    )
    check_invariants(closed)
    # The same prompts and earliest arrivals; only the dependencies differ.
    assert [(r.arrival_s, r.blocks) for r in closed.requests] == [
        (r.arrival_s, r.blocks) for r in open_loop.requests
    ]
    assert not open_loop.closed_loop
    assert closed.closed_loop
    by_id = {r.request_id: r for r in closed.requests}
    firsts = [r for r in closed.requests if r.follows is None]
    assert len(firsts) == 6
    for r in closed.requests:
        if r.follows is None:
            assert r.after_s == 0.0
            continue
        parent = by_id[r.follows]
        assert parent.request_id < r.request_id
        assert r.after_s > 0
        assert r.arrival_s == pytest.approx(parent.arrival_s + r.after_s)
        # The next turn extends its parent's prompt (its full blocks).
        full = parent.prompt_tokens // 64
        assert r.blocks[:full] == parent.blocks[:full]


def test_multi_turn_over_a_duration_starts_sessions_at_the_rate() -> None:
    workload = multi_turn(turns=5, rate_per_s=3.0, duration_s=40.0, seed=4, closed_loop=True)
    firsts = [r for r in workload.requests if r.follows is None]
    assert len(firsts) == pytest.approx(120, rel=0.2)
    assert all(r.arrival_s < 40.0 for r in firsts)
    assert len(workload.requests) == 5 * len(firsts)
