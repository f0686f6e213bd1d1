"""The fleet simulator: deterministic, faithful to step-by-step simulation, and each
policy doing what defines it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from router.scoring.policy import KvplaneScoring, RoundRobin
from simulations.fleet_sim.policies import RouterPolicy, make_policy
from simulations.fleet_sim.report import figures
from simulations.fleet_sim.requests import TraceRequest, Workload
from simulations.fleet_sim.simulator import FleetConfig, RunRecord, simulate
from simulations.fleet_sim.workloads import multi_turn, shared_prefix

# 64 blocks of 64 tokens per worker: room for about three of the eight prefix groups.
SMALL = FleetConfig(workers=4, capacity_tokens=4096)


def groups_workload(groups: int = 8, per_group: int = 12, rate: float = 20.0) -> Workload:
    return shared_prefix(
        groups=groups,
        prompts_per_group=per_group,
        system_tokens=1024,
        question_tokens=64,
        output_tokens=32,
        block_tokens=64,
        rate_per_s=rate,
        seed=3,
    )


def run(workload: Workload, policy: str, config: FleetConfig = SMALL, seed: int = 1) -> RunRecord:
    return simulate(
        workload, make_policy(policy, seed=seed, block_tokens=workload.block_tokens), config
    )


def timeline(record: RunRecord) -> list[tuple[int, float | None, float | None, int]]:
    return [(o.worker, o.first_token_s, o.finished_s, o.cached_tokens) for o in record.outcomes]


@pytest.mark.parametrize("policy", ["random", "round-robin", "least-loaded", "kvplane"])
def test_a_run_is_the_same_for_the_same_seed(policy: str) -> None:
    workload = groups_workload()
    assert timeline(run(workload, policy)) == timeline(run(workload, policy))


def test_random_policies_differ_across_seeds() -> None:
    workload = groups_workload()
    assert timeline(run(workload, "random", seed=1)) != timeline(run(workload, "random", seed=2))


def test_macro_steps_change_nothing_but_the_cost() -> None:
    workload = groups_workload(groups=4, per_group=6, rate=4.0)
    stepwise = dataclasses.replace(SMALL, macro_steps=False)
    for policy in ("round-robin", "kvplane"):
        fast, slow = run(workload, policy), run(workload, policy, stepwise)
        assert [o.worker for o in fast.outcomes] == [o.worker for o in slow.outcomes]
        for a, b in zip(fast.outcomes, slow.outcomes, strict=True):
            assert a.cached_tokens == b.cached_tokens
            assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-6)
            assert a.finished_s == pytest.approx(b.finished_s, abs=1e-6)
        assert fast.worker_work == slow.worker_work


def test_every_request_finishes_and_is_accounted_for() -> None:
    workload = groups_workload()
    record = run(workload, "kvplane")
    assert len(record.outcomes) == len(workload.requests)
    assert all(o.finished_s is not None and o.first_token_s is not None for o in record.outcomes)
    assert all(o.arrival_s <= o.first_token_s <= o.finished_s for o in record.outcomes)  # type: ignore[operator]
    assert sum(record.worker_work) > 0


def test_round_robin_takes_turns() -> None:
    counts = Counter(o.worker for o in run(groups_workload(), "round-robin").outcomes)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_round_robin_takes_turns_in_index_order_past_ten_workers() -> None:
    # Worker ids sort as their indexes do, so 10 comes after 9, not after 1.
    config = dataclasses.replace(SMALL, workers=12)
    outcomes = run(groups_workload(), "round-robin", config).outcomes
    assert [o.worker for o in outcomes[:14]] == [*range(12), 0, 1]


@pytest.mark.parametrize(
    ("name", "kind"), [("kvplane", KvplaneScoring), ("round-robin", RoundRobin)]
)
def test_kvplane_and_round_robin_are_the_routers_own_policies(name: str, kind: type) -> None:
    policy = make_policy(name, seed=0, block_tokens=64)
    assert isinstance(policy, RouterPolicy)
    assert isinstance(policy.policy, kind)


def test_least_loaded_sends_to_the_emptiest_worker() -> None:
    # All at once: with nobody finished yet, least-loaded spreads them evenly.
    workload = shared_prefix(
        groups=2, prompts_per_group=8, system_tokens=256, question_tokens=64,
        output_tokens=16, block_tokens=64, rate_per_s=None, seed=1,
    )  # fmt: skip
    counts = Counter(o.worker for o in run(workload, "least-loaded").outcomes)
    assert sorted(counts.values()) == [4, 4, 4, 4]


def test_kvplane_keeps_each_prefix_group_together_and_hits_more() -> None:
    workload = groups_workload()
    kvplane, spread = run(workload, "kvplane"), run(workload, "round-robin")
    ceiling = 1.0
    assert (
        figures(kvplane, ceiling, ceiling).hit_rate
        > figures(spread, ceiling, ceiling).hit_rate + 0.2
    )
    by_group: dict[int, Counter[int]] = {}
    for request, outcome in zip(workload.requests, kvplane.outcomes, strict=True):
        by_group.setdefault(request.blocks[0], Counter())[outcome.worker] += 1
    # Most of each group's requests went to one worker (the one holding its prefix).
    assert all(
        counts.most_common(1)[0][1] >= 0.6 * sum(counts.values()) for counts in by_group.values()
    )


def test_a_request_larger_than_a_worker_is_rejected_not_lost() -> None:
    huge = TraceRequest(0, 0.0, tuple(range(1, 400)), 400 * 64 - 10, 4)
    fits = TraceRequest(1, 0.1, (1000, 1001), 128, 4)
    record = run(Workload("t", 64, (huge, fits)), "round-robin")
    assert [o.rejected for o in record.outcomes] == [True, False]
    assert record.outcomes[1].finished_s is not None


# Closed loop and router overhead ---------------------------------------------------------


def chats(sessions: int = 6, turns: int = 3) -> Workload:
    return multi_turn(
        sessions=sessions, turns=turns, system_tokens=256, turn_tokens=64, output_tokens=16,
        think_time_s=0.5, rate_per_s=4.0, block_tokens=64, seed=2, closed_loop=True,
    )  # fmt: skip


def test_a_following_turn_is_sent_after_its_parents_response_ends() -> None:
    workload = chats()
    record = run(workload, "kvplane")
    assert len(record.outcomes) == len(workload.requests)
    by_id = {o.request_id: o for o in record.outcomes}
    assert set(by_id) == {r.request_id for r in workload.requests}
    for request in workload.requests:
        outcome = by_id[request.request_id]
        assert outcome.finished_s is not None
        if request.follows is None:
            assert outcome.arrival_s == request.arrival_s
        else:
            parent = by_id[request.follows]
            assert parent.finished_s is not None
            assert outcome.arrival_s == pytest.approx(parent.finished_s + request.after_s)
            # Later than the open-loop estimate: the parent's response took time.
            assert outcome.arrival_s > request.arrival_s


def test_followers_of_a_refused_request_are_never_sent() -> None:
    huge = TraceRequest(0, 0.0, tuple(range(1, 400)), 400 * 64 - 10, 4)
    child = TraceRequest(1, 0.5, tuple(range(1, 401)), 400 * 64 + 20, 4, follows=0, after_s=0.5)
    grandchild = TraceRequest(
        2, 1.0, tuple(range(1, 402)), 401 * 64 + 20, 4, follows=1, after_s=0.5
    )
    fits = TraceRequest(3, 0.2, (1000, 1001), 128, 4)
    record = run(Workload("t", 64, (huge, fits, child, grandchild)), "round-robin")
    assert [(o.request_id, o.rejected) for o in record.outcomes] == [(0, True), (3, False)]
    assert record.outcomes[1].finished_s is not None


def test_router_overhead_delays_each_request_of_that_policy_only() -> None:
    workload = groups_workload(groups=4, per_group=6, rate=4.0)
    slow = dataclasses.replace(SMALL, router_overhead_s={"round-robin": 0.025})
    base, delayed = run(workload, "round-robin"), run(workload, "round-robin", slow)
    assert [o.worker for o in base.outcomes] == [o.worker for o in delayed.outcomes]
    for a, b in zip(base.outcomes, delayed.outcomes, strict=True):
        assert b.arrival_s == a.arrival_s  # sent at the same time
        assert a.first_token_s is not None
        assert b.first_token_s is not None
        # At this light load nothing queues: the whole timeline moves by the overhead.
        assert b.first_token_s - a.first_token_s == pytest.approx(0.025, abs=1e-6)
    assert timeline(run(workload, "kvplane", slow)) == timeline(run(workload, "kvplane"))
    with pytest.raises(ValueError, match="negative"):
        run(
            workload,
            "round-robin",
            dataclasses.replace(SMALL, router_overhead_s={"round-robin": -1}),
        )


def test_router_overhead_counts_in_a_closed_loops_next_turn_too() -> None:
    workload = chats(sessions=2, turns=2)
    slow = dataclasses.replace(SMALL, router_overhead_s={"round-robin": 0.1})
    record = run(workload, "round-robin", slow)
    by_id = {o.request_id: o for o in record.outcomes}
    for request in workload.requests:
        outcome = by_id[request.request_id]
        assert outcome.first_token_s is not None
        assert outcome.first_token_s - outcome.arrival_s >= 0.1


def test_the_engines_counters_count_every_lookup() -> None:
    # Room for everything: one lookup per request, so the engines' hit rate is the
    # requests' cached share.
    workload = groups_workload(groups=4, per_group=6, rate=4.0)
    roomy = dataclasses.replace(SMALL, capacity_tokens=1 << 20)
    record = run(workload, "round-robin", roomy)
    assert record.cache_queries == sum(r.prompt_tokens for r in workload.requests)
    result = figures(record, 1.0, 1.0)
    assert result.engine_hit_rate == pytest.approx(result.hit_rate, abs=1e-4)
    # Caches too small for the traffic: a waiting request looks its prefix up again at
    # every step until its blocks fit, and each lookup counts, as in vLLM.
    crowded = run(groups_workload(rate=200.0), "round-robin", SMALL)
    assert crowded.cache_queries > sum(o.prompt_tokens for o in crowded.outcomes)
    assert 0 <= crowded.cache_hits <= crowded.cache_queries
