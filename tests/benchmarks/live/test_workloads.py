"""The bake-off's workloads: deterministic, and sharing text exactly where they say."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from benchmarks.live.workloads import (
    Step,
    agent_tree,
    build_workload,
    mooncake,
    multi_tenant,
    multi_turn,
    shared_prompts,
    words,
)
from kvplane.core.tokenizer import load_tokenizer


def test_text_is_the_same_for_the_same_key_and_about_the_asked_length() -> None:
    assert words("a", 200) == words("a", 200)
    assert words("a", 200) != words("b", 200)
    tokens = len(load_tokenizer().completion_tokens(words("length", 1000)))
    assert 700 < tokens < 1300


def test_shared_prompts_share_a_system_prompt_per_group_and_never_a_question() -> None:
    workload = shared_prompts(20.0, 10.0, groups=3)
    assert workload == shared_prompts(20.0, 10.0, groups=3)  # deterministic
    systems = {conversation.system for conversation in workload.conversations}
    assert len(systems) == 3
    questions = [conversation.root.text for conversation in workload.conversations]
    assert len(set(questions)) == len(questions)
    starts = [conversation.start_s for conversation in workload.conversations]
    assert starts == sorted(starts)
    assert starts[-1] < 10.0
    assert 120 < workload.requests < 280  # Poisson at 20 req/s over 10 s


def test_zipf_prompts_are_drawn_hot_head_first_and_long_tail() -> None:
    workload = build_workload("zipf-96", 15.0, 60.0, trace=Path("unused"))
    assert workload.name == "zipf-96"
    drawn = Counter(conversation.system for conversation in workload.conversations)
    hottest, hottest_draws = drawn.most_common(1)[0]
    assert hottest is not None
    assert hottest.startswith("You are assistant 0. ")
    # Zipf with exponent 1 over 96: the first prompt draws 1 / H(96), about 19%; the
    # long tail still shows up.
    assert 0.13 < hottest_draws / workload.requests < 0.26
    assert len(drawn) > 48
    uniform = Counter(c.system for c in shared_prompts(15.0, 60.0, groups=96).conversations)
    assert max(uniform.values()) < hottest_draws


def test_multi_turn_chats_are_chains_and_the_rate_counts_requests() -> None:
    workload = multi_turn(10.0, 20.0, turns=4)
    for conversation in workload.conversations:
        depth, step = 1, conversation.root
        while step.children:
            assert len(step.children) == 1
            assert step.children[0].after_s > 0
            depth, step = depth + 1, step.children[0]
        assert depth == 4
    assert 120 < workload.requests < 280
    assert len({conversation.system for conversation in workload.conversations}) == 1


def test_agent_trees_branch_from_their_own_trunk() -> None:
    workload = agent_tree(13.0, 20.0, branches=3, depth=2)
    assert all(c.root.count() == 13 for c in workload.conversations)
    trunks = [conversation.system for conversation in workload.conversations]
    assert len(set(trunks)) == len(trunks)


def test_tenants_use_the_same_texts_under_different_names() -> None:
    workload = multi_tenant(20.0, 10.0, tenants=4, prompts_per_tenant=2)
    assert workload.tenants == ("tenant0", "tenant1", "tenant2", "tenant3")
    by_tenant: dict[str | None, set[str | None]] = {}
    for conversation in workload.conversations:
        by_tenant.setdefault(conversation.tenant, set()).add(conversation.system)
    assert set(by_tenant) == set(workload.tenants)
    assert len(set.union(*by_tenant.values())) == 2


def test_the_mooncake_replay_samples_whole_families_across_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    families = [1, 2, 3, 4, 5, 6] * 20
    rows: list[dict[str, Any]] = [
        {"timestamp": 100 * n, "input_length": 1536, "output_length": 160, "hash_ids": [0, f, n]}
        for n, f in enumerate(families)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workload = mooncake(2.0, 20.0, trace=trace, tokens_per_block=20, max_tokens=16)
    assert workload == mooncake(2.0, 20.0, trace=trace, tokens_per_block=20, max_tokens=16)

    def text(row: dict[str, Any]) -> str:
        return " ".join(words(f"mooncake-block-{block}", 20) for block in row["hash_ids"])

    sampled = {conversation.root.text for conversation in workload.conversations}
    kept = {
        f for f in set(families) if any(text(r) in sampled for r in rows if r["hash_ids"][1] == f)
    }
    assert 0 < len(kept) < 6  # a sample (2 req/s for 20 s of 120 requests: one in three)
    assert sampled == {text(r) for r in rows if r["hash_ids"][1] in kept}  # whole families
    starts = [conversation.start_s for conversation in workload.conversations]
    assert starts == sorted(starts)
    assert starts[0] == 0.0
    assert starts[-1] == pytest.approx(20.0)  # the trace's time compressed into 20 s
    assert {c.root.max_tokens for c in workload.conversations} == {10}  # 160 // 16


def test_unknown_workloads_and_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("shared-x", 1.0, 1.0, trace=Path("unused"))
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("chat", 1.0, 1.0, trace=Path("unused"))
    with pytest.raises(ValueError, match="positive"):
        shared_prompts(0.0, 1.0, groups=2)


def test_a_step_counts_its_whole_subtree() -> None:
    leaf = Step("c", 1)
    assert Step("a", 1, children=(Step("b", 1, children=(leaf,)), leaf)).count() == 4
