"""The peers' policies, each doing what defines it, on hand-built router views; and each
through one small simulation."""

from __future__ import annotations

import random
from collections import Counter
from typing import Literal

import pytest

from simulations.fleet_sim.peer_policies import (
    DynamoPolicy,
    LlmdPolicy,
    SglangCacheAwarePolicy,
    VllmRouterCacheAwarePolicy,
)
from simulations.fleet_sim.policies import POLICIES, Policy, make_policy
from simulations.fleet_sim.requests import TraceRequest
from simulations.fleet_sim.router_view import LoadReport, RouterView
from simulations.fleet_sim.simulator import FleetConfig, RunRecord, simulate
from simulations.fleet_sim.worker import WorkerLoad
from simulations.fleet_sim.workloads import shared_prefix

BT = 64  # tokens per block


def request(rid: int, blocks: list[int], prompt_tokens: int | None = None) -> TraceRequest:
    tokens = len(blocks) * BT if prompt_tokens is None else prompt_tokens
    return TraceRequest(rid, 0.0, tuple(blocks), tokens, output_tokens=16)


def chain(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def set_loads(view: RouterView, loads: list[int]) -> None:
    for w, load in enumerate(loads):
        view.traffic[w].in_flight = load


def report(view: RouterView, worker: int, waiting: int, kv_usage: float, at: float) -> None:
    view.report(worker, LoadReport(WorkerLoad(waiting, 0, kv_usage), at))


# -- SGLang ------------------------------------------------------------------------------


def sglang(
    cache_threshold: float = 0.3, max_tree_size: int = 67_108_864, eviction_interval_s: float = 120
) -> SglangCacheAwarePolicy:
    return SglangCacheAwarePolicy(
        random.Random(0),
        BT,
        cache_threshold=cache_threshold,
        max_tree_size=max_tree_size,
        eviction_interval_s=eviction_interval_s,
    )


def test_sglang_routes_to_the_best_match_above_the_threshold() -> None:
    policy, view = sglang(), RouterView(4)
    first = request(1, chain(100, 10))
    assert policy.choose(first, view, 0.0) == 0  # nothing matches: least loaded, lowest index
    set_loads(view, [5, 0, 0, 0])  # balanced (5 - 0 <= 64)
    # 8 of 10 blocks match worker 0's tree: 0.8 > 0.3, despite worker 0 being the busiest.
    sibling = request(2, [*chain(100, 8), 900, 901])
    assert policy.choose(sibling, view, 1.0) == 0
    assert policy.cache_hits == 1


def test_sglang_routes_to_the_least_loaded_below_the_threshold() -> None:
    policy, view = sglang(), RouterView(4)
    policy.choose(request(1, chain(100, 10)), view, 0.0)
    set_loads(view, [3, 2, 0, 1])
    # 2 of 10 blocks match (0.2 <= 0.3): the least-loaded worker, not the matching one.
    assert policy.choose(request(2, [*chain(100, 2), *chain(500, 8)]), view, 1.0) == 2
    # At exactly the threshold it still does not count as a hit (strictly greater).
    policy2, view2 = sglang(cache_threshold=0.2), RouterView(4)
    policy2.choose(request(1, chain(100, 10)), view2, 0.0)
    set_loads(view2, [3, 2, 0, 1])
    assert policy2.choose(request(2, [*chain(100, 2), *chain(500, 8)]), view2, 1.0) == 2


def test_sglang_match_rate_counts_tokens_of_the_partial_last_block() -> None:
    policy, view = sglang(), RouterView(2)
    # Worker 0 holds one full block (64 tokens) of a 200-token prompt: 0.32 > 0.3.
    policy.choose(request(1, [7, 70], prompt_tokens=100), view, 0.0)
    set_loads(view, [1, 0])
    assert policy.choose(request(2, [7, 71, 72, 73], prompt_tokens=200), view, 1.0) == 0
    # Of a 256-token prompt it is 0.25: the least loaded instead.
    assert policy.choose(request(3, [7, 81, 82, 83], prompt_tokens=256), view, 2.0) == 1


def test_sglang_balances_when_imbalanced_even_with_a_full_match() -> None:
    policy, view = sglang(), RouterView(4)
    prompt = request(1, chain(100, 10))
    policy.choose(prompt, view, 0.0)
    set_loads(view, [100, 10, 30, 40])  # 90 > 64 and 100 > 1.5 * 10
    assert policy.choose(request(2, chain(100, 10)), view, 1.0) == 1
    assert policy.load_balanced == 1
    # The imbalanced branch still inserted the prompt into worker 1's tree.
    assert policy.matched_tokens(1, prompt) == 10 * BT
    # Both conditions are needed: a large gap with a small ratio is balanced.
    set_loads(view, [210, 140, 150, 160])  # 70 > 64 but 210 = 1.5 * 140, not above
    assert policy.choose(request(3, chain(100, 10)), view, 2.0) == 0  # the match again


def test_sglang_learns_only_from_its_own_decisions() -> None:
    policy, view = sglang(), RouterView(4)
    prompt = request(1, chain(100, 10))
    view.events(3, stored=prompt.blocks, removed=[], cleared=False)  # engine says: on 3
    set_loads(view, [1, 0, 0, 0])
    assert policy.choose(prompt, view, 0.0) == 1  # no match in its trees: least loaded
    policy.events(1, removed=list(prompt.blocks), cleared=True, now=0.0)  # ignored
    set_loads(view, [0, 1, 0, 0])
    assert policy.choose(request(2, chain(100, 10)), view, 1.0) == 1  # its own tree
    assert policy.matched_tokens(3, prompt) == 0


def test_sglang_names_the_first_holder_among_equal_matches() -> None:
    policy, view = sglang(), RouterView(3)
    prompt = request(1, chain(100, 10))
    policy.choose(prompt, view, 0.0)  # -> 0
    set_loads(view, [100, 0, 0])  # imbalanced: the same prompt goes to 1 as well
    assert policy.choose(prompt, view, 1.0) == 1
    set_loads(view, [1, 1, 0])
    # Both hold it fully; the node's tenant is the worker that created it.
    assert policy.choose(request(2, chain(100, 10)), view, 2.0) == 0


def test_sglang_evicts_least_recently_used_leaves_to_the_size_limit() -> None:
    # 4 characters per token: 2,560 characters = 640 tokens = 10 blocks per worker.
    policy, view = sglang(max_tree_size=2560, eviction_interval_s=10.0), RouterView(1)
    old = request(1, [*chain(100, 4), *chain(200, 4)])  # shared head 100..103
    new = request(2, [*chain(100, 4), *chain(300, 4)])
    newest = request(3, [*chain(100, 4), *chain(400, 4)])
    for i, r in enumerate((old, new, newest)):
        policy.choose(r, view, float(i))
    assert policy.tree_tokens(0) == 16 * BT  # 4 shared + 3 * 4, over the limit
    policy.choose(request(4, chain(900, 1)), view, 9.0)  # before the interval: kept
    assert policy.tree_tokens(0) == 17 * BT
    policy.choose(request(5, chain(901, 1)), view, 10.0)  # eviction runs first
    # The least recently used leaves went first: the 200.. branch, then 300.. from its
    # tail, until 10 blocks were left (900, touched at 9 s, stays).
    assert policy.matched_tokens(0, old) == 4 * BT
    assert policy.matched_tokens(0, newest) == 8 * BT
    assert policy.matched_tokens(0, new) == 5 * BT
    assert policy.matched_tokens(0, request(6, chain(900, 1))) == BT
    assert policy.tree_tokens(0) == 11 * BT  # 10 blocks kept + the new request's block
    assert policy.evicted_blocks == 7


def test_sglang_defaults_are_sglang_router_0_3_2s() -> None:
    # sglang_router/router_args.py of the 0.3.2 wheel, lines 33-37.
    policy = SglangCacheAwarePolicy(random.Random(0), BT)
    assert policy.cache_threshold == 0.3
    assert (policy.balance_abs_threshold, policy.balance_rel_threshold) == (64, 1.5)
    assert policy.eviction_interval_s == 60.0
    assert policy.max_tree_tokens == 2**26 // 4


def test_sglang_evicts_every_60_seconds_by_default() -> None:
    policy, view = SglangCacheAwarePolicy(random.Random(0), BT, max_tree_size=4 * BT), RouterView(1)
    policy.choose(request(1, chain(100, 4)), view, 0.0)
    policy.choose(request(2, chain(200, 1)), view, 59.0)
    assert policy.evicted_blocks == 0
    policy.choose(request(3, chain(300, 1)), view, 60.0)
    assert policy.evicted_blocks > 0


def test_vllm_router_cache_aware_is_sglangs_decision_with_its_own_defaults() -> None:
    # vllm_router/router_args.py of the 0.1.17 wheel, lines 40-44.
    vllm = make_policy("vllm-router-cache-aware", seed=0, block_tokens=BT)
    assert isinstance(vllm, VllmRouterCacheAwarePolicy)
    assert isinstance(vllm, SglangCacheAwarePolicy)
    assert vllm.cache_threshold == 0.3
    assert (vllm.balance_abs_threshold, vllm.balance_rel_threshold) == (64, 1.5)
    assert vllm.eviction_interval_s == 120.0
    assert vllm.max_tree_tokens == 2**25 // 4
    # Before any eviction is due, both route a workload the same way.
    workload = shared_prefix(
        groups=6, prompts_per_group=8, system_tokens=512, question_tokens=64,
        output_tokens=16, block_tokens=BT, rate_per_s=20.0, seed=1,
    )  # fmt: skip
    config = FleetConfig(workers=4, capacity_tokens=4096)
    sglang_run = simulate(
        workload, make_policy("sglang-cache-aware", seed=0, block_tokens=BT), config
    )
    vllm_run = simulate(workload, vllm, config)
    assert [o.worker for o in vllm_run.outcomes] == [o.worker for o in sglang_run.outcomes]


# -- llm-d -------------------------------------------------------------------------------


def llmd(
    seed: int = 0, prefix_normalisation: Literal["fraction", "min-max"] = "fraction"
) -> LlmdPolicy:
    return LlmdPolicy(random.Random(seed), BT, prefix_normalisation=prefix_normalisation)


def test_llmd_weights_prefix_against_queue_and_kv_usage() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    view.events(0, stored=prompt.blocks, removed=[], cleared=False)
    report(view, 0, waiting=4, kv_usage=0.0, at=0.0)  # the prefix, the longer queue
    report(view, 1, waiting=0, kv_usage=0.0, at=0.0)  # idle, no prefix
    policy = llmd()
    # 3 * 1 + 2 * 0 + 2 * 1 = 5 against 3 * 0 + 2 * 1 + 2 * 1 = 4.
    assert policy.scores(prompt, view, 0.5) == pytest.approx([5.0, 4.0])
    assert policy.choose(prompt, view, 0.5) == 0
    # A fuller cache tips it: 3 + 0 + 2 * 0.4 = 3.8 < 4.
    report(view, 0, waiting=4, kv_usage=0.6, at=0.0)
    assert llmd().choose(prompt, view, 0.5) == 1


def test_llmd_prefix_score_fraction_or_min_max() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(3)
    view.events(0, stored=prompt.blocks[:5], removed=[], cleared=False)
    view.events(1, stored=prompt.blocks[:2], removed=[], cleared=False)
    assert llmd().prefix_scores(prompt, view, 0.0) == pytest.approx([0.5, 0.2, 0.0])
    minmax = llmd(prefix_normalisation="min-max")
    assert minmax.prefix_scores(prompt, view, 0.0) == pytest.approx([1.0, 0.0, 0.0])
    view.events(1, stored=[], removed=prompt.blocks[:2], cleared=False)
    assert minmax.prefix_scores(prompt, view, 0.0) == pytest.approx([1.0, 0.0, 0.0])
    # Half the prefix and a queue against an idle worker: 1.5 + 0 + 2 < 0 + 2 + 2 with
    # the fraction, 3 + 0 + 2 > 4 with min-max.
    report(view, 0, waiting=3, kv_usage=0.0, at=0.0)
    report(view, 1, waiting=0, kv_usage=0.0, at=0.0)
    report(view, 2, waiting=0, kv_usage=0.0, at=0.0)
    assert llmd().choose(prompt, view, 0.1) in (1, 2)
    assert llmd(prefix_normalisation="min-max").choose(prompt, view, 0.1) == 0


def test_llmd_queue_scores_are_min_max_inverted() -> None:
    view = RouterView(3)
    report(view, 0, waiting=2, kv_usage=0.0, at=0.0)
    report(view, 1, waiting=6, kv_usage=0.0, at=0.0)  # worker 2: no report, queue 0
    assert llmd().queue_scores(view, 0.0) == pytest.approx([4 / 6, 0.0, 1.0])
    report(view, 1, waiting=0, kv_usage=0.0, at=0.0)
    report(view, 0, waiting=0, kv_usage=0.0, at=0.0)
    assert llmd().queue_scores(view, 0.0) == [1.0, 1.0, 1.0]


def test_llmd_speculative_entries_hold_for_two_seconds() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(4)
    policy = llmd(seed=5)
    chosen = policy.choose(prompt, view, 0.0)  # nothing known: at random
    for w in range(4):  # now the chosen worker has the longest queue
        report(view, w, waiting=3 if w == chosen else 0, kv_usage=0.0, at=0.0)
    # Within 2 s the speculative prefix wins: 3 + 0 + 2 = 5 > 0 + 2 + 2.
    assert policy.choose(request(2, chain(100, 10)), view, 1.9) == chosen
    # 2 s after the last record (1.9 s) it has expired: the queue decides.
    assert policy.choose(request(3, chain(100, 10)), view, 3.95) != chosen


def test_llmd_removal_events_drop_speculative_entries() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    policy = llmd()
    chosen = policy.choose(prompt, view, 0.0)
    report(view, chosen, waiting=3, kv_usage=0.0, at=0.0)
    report(view, 1 - chosen, waiting=0, kv_usage=0.0, at=0.0)
    policy.events(chosen, removed=list(prompt.blocks), cleared=False, now=0.0)
    assert policy.prefix_scores(prompt, view, 0.5) == [0.0, 0.0]
    assert policy.choose(prompt, view, 0.5) == 1 - chosen


def test_llmd_partial_last_block_has_no_key() -> None:
    prompt = request(1, [*chain(100, 3), 999], prompt_tokens=3 * BT + 10)
    view = RouterView(2)
    view.events(0, stored=prompt.blocks[:3], removed=[], cleared=False)
    assert llmd().prefix_scores(prompt, view, 0.0) == [1.0, 0.0]


def test_llmd_ties_at_random_but_deterministic_for_a_seed() -> None:
    prompt = request(1, chain(100, 4))
    picks = {llmd(seed=s).choose(prompt, RouterView(4), 0.0) for s in range(40)}
    assert picks == {0, 1, 2, 3}
    assert llmd(seed=7).choose(prompt, RouterView(4), 0.0) == llmd(seed=7).choose(
        prompt, RouterView(4), 0.0
    )


def test_llmd_approximate_estimates_from_its_own_decisions_only() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    policy = LlmdPolicy(random.Random(0), BT, prefix_source="decisions", capacity_blocks=12)
    assert policy.name == "llm-d-approximate"
    view.events(1, stored=prompt.blocks, removed=[], cleared=False)  # never read
    assert policy.prefix_scores(prompt, view, 0.0) == [0.0, 0.0]
    report(view, 0, waiting=0, kv_usage=0.0, at=0.0)
    report(view, 1, waiting=2, kv_usage=0.0, at=0.0)
    assert policy.choose(prompt, view, 0.0) == 0
    # Believed on worker 0 although no event said so, and still after the engine's
    # removals, which the estimate is never told of.
    view.events(0, stored=[], removed=prompt.blocks, cleared=False)
    policy.events(0, removed=list(prompt.blocks), cleared=True, now=0.0)
    assert policy.prefix_scores(prompt, view, 1.0) == [1.0, 0.0]
    # The estimate holds the worker's capacity: 12 blocks, least recently routed out.
    policy.choose(request(2, chain(500, 4)), view, 2.0)
    assert policy.prefix_scores(prompt, view, 3.0) == [0.0, 0.0]  # blocks 100, 101 gone
    assert policy.prefix_scores(request(3, chain(500, 4)), view, 3.0) == [1.0, 0.0]


def test_llmd_approximate_needs_the_capacity_and_load_only_has_no_prefix() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LlmdPolicy(random.Random(0), BT, prefix_source="decisions")
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    view.events(0, stored=prompt.blocks, removed=[], cleared=False)
    report(view, 0, waiting=1, kv_usage=0.0, at=0.0)
    report(view, 1, waiting=0, kv_usage=0.0, at=0.0)
    load_only = LlmdPolicy(random.Random(0), BT, prefix_source="none")
    assert load_only.name == "llm-d-load"
    assert load_only.prefix_scores(prompt, view, 0.0) == [0.0, 0.0]
    assert load_only.choose(prompt, view, 0.0) == 1
    assert llmd().choose(prompt, view, 0.0) == 0


def test_llmd_scores_on_stale_metrics_and_counts_them() -> None:
    view = RouterView(2)
    report(view, 0, waiting=5, kv_usage=0.5, at=0.0)
    report(view, 1, waiting=0, kv_usage=0.0, at=9.0)
    policy = llmd()
    assert policy.queue_scores(view, 10.0) == [0.0, 1.0]  # the stale one still counts
    assert policy.stale_reports == 1


# -- Dynamo ------------------------------------------------------------------------------


def dynamo(seed: int = 0, overlap_score_weight: float = 1.0) -> DynamoPolicy:
    return DynamoPolicy(random.Random(seed), BT, overlap_score_weight=overlap_score_weight)


def test_dynamo_cost_is_overlap_weighted_prefill_plus_decode_blocks() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    view.events(0, stored=prompt.blocks[:8], removed=[], cleared=False)
    policy = dynamo()
    # Worker 0: 2 uncached blocks + 10 decode blocks; worker 1: 10 + 10.
    assert policy.costs(prompt, view) == pytest.approx([12.0, 20.0])
    assert policy.choose(prompt, view, 0.0) == 0
    weighted = dynamo(overlap_score_weight=2.0)
    assert weighted.costs(prompt, view) == pytest.approx([14.0, 30.0])


def test_dynamo_counts_prefill_already_queued_by_this_router() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    view.events(0, stored=prompt.blocks[:8], removed=[], cleared=False)
    view.sent(0, request_id=50, now=0.0, uncached_tokens=20 * BT)  # someone else's
    policy = dynamo()
    assert policy.costs(prompt, view)[0] == pytest.approx(22.0 + 10.0)
    assert policy.choose(prompt, view, 0.0) == 1


def test_dynamo_decode_blocks_track_its_active_requests() -> None:
    view = RouterView(2)
    policy = dynamo()
    first = request(1, [*chain(100, 6), 700])
    chosen = policy.choose(first, view, 0.0)
    view.sent(chosen, 1, 0.0, first.prompt_tokens)
    assert policy.active_blocks(chosen) == 7
    view.first_token(chosen, 1)  # prefill done: no queued prefill, blocks still active
    sibling = request(2, [*chain(100, 6), 701])
    costs = policy.costs(sibling, view)
    # Sharing 6 active blocks: 7 + 1 new decode blocks there, against 7 elsewhere.
    assert costs[chosen] == pytest.approx(7.0 + 8.0)
    assert costs[1 - chosen] == pytest.approx(7.0 + 7.0)
    view.finished(chosen, 1)
    assert policy.costs(sibling, view)[chosen] == pytest.approx(7.0 + 7.0)
    assert policy.active_blocks(chosen) == 0


def test_dynamo_retires_decoding_requests_before_prefilling_ones() -> None:
    view = RouterView(1)
    policy = dynamo()
    a, b = request(1, chain(100, 3)), request(2, chain(200, 5))
    for r in (a, b):
        policy.choose(r, view, 0.0)
        view.sent(0, r.request_id, 0.0, r.prompt_tokens)
    view.first_token(0, 2)
    view.finished(0, 2)  # the later one finished first
    policy.costs(a, view)
    assert policy.active_blocks(0) == 3


def test_dynamo_ties_go_to_the_smallest_index_tree() -> None:
    prompt = request(1, chain(100, 4))
    view = RouterView(3)
    view.events(0, stored=chain(500, 9), removed=[], cleared=False)
    view.events(2, stored=chain(600, 3), removed=[], cleared=False)
    assert dynamo().choose(prompt, view, 0.0) == 1
    picks = {dynamo(seed=s).choose(prompt, RouterView(3), 0.0) for s in range(30)}
    assert picks == {0, 1, 2}


def test_dynamo_temperature_samples_towards_lower_cost() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(2)
    view.events(0, stored=prompt.blocks[:8], removed=[], cleared=False)  # costs 12, 20

    def picks(seed: int, temperature: float) -> Counter[int]:
        rng = random.Random(seed)
        return Counter(
            DynamoPolicy(rng, BT, temperature=temperature).choose(prompt, view, 0.0)
            for _ in range(2000)
        )

    counts = picks(3, 1.0)
    # Normalised by the range 8: p(0) = 1 / (1 + e^-1) = 0.731.
    assert 0.70 < counts[0] / 2000 < 0.76
    assert picks(3, 1.0) == counts  # deterministic for a seed
    hot = picks(3, 100.0)
    assert 0.45 < hot[0] / 2000 < 0.55  # a high temperature is nearly uniform
    assert picks(3, 0.05)[0] == 2000  # a low one is nearly argmin


# -- end to end ----------------------------------------------------------------------------


def _run(policy: Policy) -> RunRecord:
    workload = shared_prefix(
        groups=6,
        prompts_per_group=8,
        system_tokens=1024,
        question_tokens=64,
        output_tokens=32,
        block_tokens=BT,
        rate_per_s=20.0,
        seed=3,
    )
    return simulate(workload, policy, FleetConfig(workers=4, capacity_tokens=8192))


def _policy(name: str, seed: int) -> Policy:
    return make_policy(name, seed=seed, block_tokens=BT, capacity_tokens=8192)


@pytest.mark.parametrize(
    "name",
    ["sglang-cache-aware", "llm-d-precise", "llm-d-approximate", "dynamo", "longest-prefix"],
)
def test_each_prefix_aware_policy_runs_a_fleet_deterministically(name: str) -> None:
    record = _run(_policy(name, 1))
    assert all(o.finished_s is not None for o in record.outcomes)
    again = _run(_policy(name, 1))
    assert [(o.worker, o.finished_s) for o in record.outcomes] == [
        (o.worker, o.finished_s) for o in again.outcomes
    ]
    cached = sum(o.cached_tokens for o in record.outcomes)
    baseline = sum(o.cached_tokens for o in _run(_policy("random", 1)).outcomes)
    assert cached > baseline


# -- longest prefix and the registry ----------------------------------------------------


def test_longest_prefix_ignores_load_and_breaks_ties_by_it() -> None:
    prompt = request(1, chain(100, 10))
    view = RouterView(3)
    view.events(2, stored=prompt.blocks[:6], removed=[], cleared=False)
    view.events(1, stored=prompt.blocks[:3], removed=[], cleared=False)
    set_loads(view, [0, 0, 50])
    policy = make_policy("longest-prefix", seed=0, block_tokens=BT)
    assert policy.choose(prompt, view, 0.0) == 2  # the longest prefix, however loaded
    set_loads(view, [4, 1, 9])
    assert policy.choose(request(2, chain(900, 5)), view, 0.0) == 1  # none: fewest in flight


@pytest.mark.parametrize("name", POLICIES)
def test_every_listed_policy_is_made_under_its_name(name: str) -> None:
    assert make_policy(name, seed=0, block_tokens=BT, capacity_tokens=8192).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nearest", seed=0, block_tokens=BT)
