"""The routing score: each term in prefill tokens, pure, explainable, ties at random."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvplane.core.config import ScoringSettings
from kvplane.core.types import Tier
from router.scoring.score import (
    RequestFacts,
    ScoreBreakdown,
    deciding_factor,
    hit_value,
    queue_estimate,
    rank_by_score,
    score_candidates,
    spill_excess,
)
from tests.router.scoring.facts import WorkerFacts, facts_of

WEIGHTS = ScoringSettings()


def worker(worker_id: str, device: int = 0, **state: object) -> WorkerFacts:
    return WorkerFacts(worker_id, {Tier.DEVICE: device} if device else {}, **state)  # type: ignore[arg-type]


def score_worker(
    request: RequestFacts, worker: WorkerFacts, weights: ScoringSettings
) -> ScoreBreakdown:
    return score_candidates(request, facts_of([worker]), weights).breakdown(0)


def rank_workers(
    request: RequestFacts, workers: Sequence[WorkerFacts], seed: int = 0
) -> list[ScoreBreakdown]:
    scores = score_candidates(request, facts_of(workers), WEIGHTS)
    return list(rank_by_score(scores, np.random.default_rng(seed)))


def best(request: RequestFacts, *workers: WorkerFacts, seed: int = 0) -> str:
    return rank_workers(request, workers, seed)[0].worker_id


def test_slower_tiers_are_worth_what_restoring_saves_over_recomputing() -> None:
    assert hit_value(Tier.DEVICE, WEIGHTS) == 1.0
    # 128 KiB per token over 25 GB/s against 12,500 tokens/s of prefill.
    assert hit_value(Tier.HOST, WEIGHTS) == pytest.approx(1 - 131_072 / 25e9 * 12_500)
    assert 0 < hit_value(Tier.DISK, WEIGHTS) < hit_value(Tier.HOST, WEIGHTS)
    assert hit_value(Tier.REMOTE, WEIGHTS) == 0.0  # slower than recomputing: worth nothing
    no_host = WEIGHTS.model_copy(update={"host_bandwidth_bytes_per_s": 0.0})
    assert hit_value(Tier.HOST, no_host) == 0.0


def test_the_longest_cached_prefix_wins_when_all_else_is_equal() -> None:
    request = RequestFacts(prompt_tokens=4096)
    assert best(request, worker("a", 1024), worker("b", 3072), worker("c")) == "b"
    host = WorkerFacts("h", {Tier.HOST: 3072})
    assert best(request, worker("d", 2048), host) == "h"  # 3072 x 0.93 > 2048


def test_a_long_queue_sends_a_hot_prefix_elsewhere() -> None:
    request = RequestFacts(prompt_tokens=2048)
    idle = worker("idle", 0)
    # Enough waiting requests to outweigh the whole cached prefix, whatever the weight.
    enough = int(2048 // WEIGHTS.waiting_request_tokens) + 1
    busy = worker("busy", 2048, waiting_requests=enough)
    assert best(request, busy, idle) == "idle"
    assert best(request, worker("busy", 2048, waiting_requests=1), idle) == "busy"
    # Queued prefill work worth more than the cached prefix, whatever the weight.
    queued_tokens = int(2048 / WEIGHTS.queued_prefill_weight) + 1
    queued = worker("queued", 2048, queued_prefill_tokens=queued_tokens)
    assert best(request, queued, idle) == "idle"


def test_past_the_spill_gate_each_request_over_the_mean_costs_more() -> None:
    # Every chat starts with the same system prompt, cached on one worker so far.
    request = RequestFacts(prompt_tokens=1152)
    cold = [worker(f"cold-{n}", running_requests=1) for n in range(3)]
    hot = worker("hot", 1024, running_requests=9)  # the mean is 3: 9 > 3 + 4 and > 1.5 x 3
    ranked = rank_workers(request, [hot, *cold])
    assert ranked[0].worker_id != "hot"
    (spilled,) = [b for b in ranked if b.worker_id == "hot"]
    assert spilled.spilled
    assert (spilled.cached_tokens, spilled.saved_tokens) == (1024, 1024.0)
    assert spilled.queue_penalty == 9 * WEIGHTS.running_request_tokens + 6 * 256
    assert not any(b.spilled for b in ranked if b.worker_id != "hot")
    # A longer prefix is worth more queueing: 2,048 cached tokens outweigh the same queue.
    longer = RequestFacts(prompt_tokens=2176)
    assert best(longer, worker("hot", 2048, running_requests=9), *cold) == "hot"
    # Within the margin the cache keeps it (the mean is 2.25: 6 < 6.25).
    assert best(request, worker("hot", 1024, running_requests=6), *cold) == "hot"
    # When the whole fleet is busy the ratio keeps it too (the mean is 24: 30 < 36).
    busy = [worker(f"busy-{n}", running_requests=22) for n in range(3)]
    assert best(request, worker("hot", 1024, running_requests=30), *busy) == "hot"
    off = WEIGHTS.model_copy(update={"spill_margin_requests": 0.0})
    scores = score_candidates(request, facts_of([hot, *cold]), off)
    assert not scores.spilled.any()
    assert int(np.argmax(scores.total)) == 0


def test_the_spill_never_costs_more_than_its_cap() -> None:
    # An agent's step: its own ~2,100-token context is cached on the crowded worker only.
    step = RequestFacts(prompt_tokens=2224)
    idle = [worker(f"idle-{n}") for n in range(3)]
    crowded = worker("crowded", 2160, running_requests=16)  # the mean 4: 12 over it
    (penalised,) = [b for b in rank_workers(step, [crowded, *idle]) if b.worker_id == "crowded"]
    assert penalised.spilled
    assert penalised.queue_penalty == 16 * WEIGHTS.running_request_tokens + 1536
    assert best(step, crowded, *idle) == "crowded"
    # Uncapped, 12 requests over the mean (3,072 tokens) would have sent it to prefill again.
    uncapped = WEIGHTS.model_copy(update={"spill_max_tokens": float("inf")})
    scores = score_candidates(step, facts_of([crowded, *idle]), uncapped)
    assert int(np.argmax(scores.total)) != 0
    # A chat's turn, whose history of its own is short, still moves under the cap.
    turn = RequestFacts(prompt_tokens=1600)
    holder = worker("holder", 1536, running_requests=16)
    others = [worker(f"other-{n}", 1024) for n in range(3)]
    assert best(turn, holder, *others) != "holder"


def test_the_spill_gate_counts_waiting_requests_and_opens_on_the_ratio_at_a_high_mean() -> None:
    request = RequestFacts(prompt_tokens=1152)
    cold = [worker(f"cold-{n}", running_requests=1) for n in range(3)]
    waiting = rank_workers(request, [worker("hot", 1024, waiting_requests=9), *cold])
    assert [b.spilled for b in waiting if b.worker_id == "hot"] == [True]
    # The mean is 15: the ratio sets the gate at 22.5, over the margin's 19.
    busy = [worker(f"busy-{n}", running_requests=10) for n in range(3)]
    at_gate = rank_workers(request, [worker("hot", 1024, running_requests=30), *busy])
    (hot,) = [b for b in at_gate if b.worker_id == "hot"]
    assert hot.spilled
    # 15 requests over the mean (3,840 tokens), capped.
    assert hot.queue_penalty == 30 * WEIGHTS.running_request_tokens + WEIGHTS.spill_max_tokens
    # Exactly at the gate (the mean 2, the margin's 6): not over it, not spilled.
    level = [worker(f"level-{n}", running_requests=1) for n in range(4)]
    on_gate = rank_workers(request, [worker("hot", 1024, running_requests=6), *level])
    assert not any(b.spilled for b in on_gate)
    over = rank_workers(request, [worker("hot", 1024, running_requests=7), *level])
    assert [b.worker_id for b in over if b.spilled] == ["hot"]
    free = WEIGHTS.model_copy(update={"spill_request_tokens": 0.0})
    scores = score_candidates(request, facts_of([worker("hot", running_requests=9), *cold]), free)
    assert not scores.spilled.any()


def test_a_worker_is_judged_against_peers_whose_load_is_known_the_same_way() -> None:
    """A router replica has the load reports of the workers whose agents stream to it,
    and of the others only its own requests: about a third of their load with three
    replicas. Judged together, the reported workers would all look crowded."""
    request = RequestFacts(prompt_tokens=1152)
    reported = [worker(f"mine-{n}", 1024, running_requests=12) for n in range(2)]
    elsewhere = [worker(f"theirs-{n}", running_requests=4, load_reported=False) for n in range(4)]
    assert not any(b.spilled for b in rank_workers(request, [*reported, *elsewhere]))
    # Among the unreported ones, a worker this router alone crowds still spills.
    crowded = worker("theirs-hot", 1024, running_requests=12, load_reported=False)
    ranked = rank_workers(request, [*reported, *elsewhere, crowded])
    assert [b.worker_id for b in ranked if b.spilled] == ["theirs-hot"]


def test_only_the_eligible_workers_make_the_mean_a_spill_is_judged_by() -> None:
    request = RequestFacts(prompt_tokens=1152, isolation="dedicated", pool="gold")
    # The other pool is idle: judged against it, the pool's own hot worker would spill.
    idle_elsewhere = [worker(f"other-{n}") for n in range(6)]
    gold = [
        worker("hot", 1024, running_requests=9, pool="gold"),
        worker("gold-2", running_requests=3, pool="gold"),
    ]
    ranked = rank_workers(request, [*idle_elsewhere, *gold])
    assert ranked[0].worker_id == "hot"
    assert not any(b.spilled for b in ranked)


def test_memory_pressure_counts_only_near_full_and_only_new_tokens() -> None:
    request = RequestFacts(prompt_tokens=1000)
    calm = score_worker(request, worker("a", 0, kv_usage=0.85), WEIGHTS)
    assert calm.memory_penalty == 0.0
    full = score_worker(request, worker("b", 400, kv_usage=0.95), WEIGHTS)
    assert full.memory_penalty == pytest.approx(0.5 * 600)  # half way into the last 10 %


def test_a_cache_turning_over_is_under_pressure_whatever_its_usage() -> None:
    request = RequestFacts(prompt_tokens=1000)
    turning = score_worker(request, worker("a", 400, kv_usage=0.1, evicted_share=0.5), WEIGHTS)
    assert turning.memory_penalty == pytest.approx(0.5 * 600)
    # The larger of the two pressures counts, never their sum.
    both = score_worker(request, worker("b", 400, kv_usage=0.95, evicted_share=0.2), WEIGHTS)
    assert both.memory_penalty == pytest.approx(0.5 * 600)
    # A prompt that shares nothing with a worker that keeps evicting goes to one that
    # does not, though it runs more; its cached prompt still stays where it is cached.
    calm = worker("calm", running_requests=4)
    assert best(request, worker("evicting", evicted_share=1.0), calm) == "calm"
    assert best(request, worker("evicting", 1000, evicted_share=1.0), calm) == "evicting"


def test_new_tokens_another_worker_holds_are_a_copy_priced_apart() -> None:
    request = RequestFacts(prompt_tokens=1000)
    holder = worker("holder", 600, kv_usage=0.95)
    other = worker("other", kv_usage=0.95)  # half way into the last 10 %: pressure 0.5
    scores = score_candidates(request, facts_of([holder, other]), WEIGHTS)
    held, copying = scores.breakdown(0), scores.breakdown(1)
    assert (held.copied_tokens, held.copy_penalty) == (0, 0.0)
    assert copying.copied_tokens == 600
    assert copying.copy_penalty == pytest.approx(0.5 * 600)
    # The rest is new to the fleet wherever it goes: the same memory penalty on both.
    assert held.memory_penalty == copying.memory_penalty == pytest.approx(0.5 * 400)
    # At equal weights the two terms add up to what every new token costs.
    assert copying.memory_penalty + copying.copy_penalty == pytest.approx(0.5 * 1000)
    priced = ScoringSettings(copy_pressure_weight=3.0)
    assert score_candidates(request, facts_of([holder, other]), priced).breakdown(
        1
    ).copy_penalty == pytest.approx(3 * 0.5 * 600)
    # The breakdown adds the copy in.
    assert copying.score == pytest.approx(
        copying.saved_tokens
        - copying.queue_penalty
        - copying.memory_penalty
        - copying.copy_penalty
        - copying.tenant_penalty
    )


def test_a_prefix_in_host_memory_still_takes_device_blocks_and_is_no_copy_there() -> None:
    """Restored or computed, every token not on the device takes a device block: a
    worker holding the prefix in host memory is ahead by its tier credit alone."""
    request = RequestFacts(prompt_tokens=1000)
    host = WorkerFacts("host", {Tier.HOST: 600}, kv_usage=0.95)  # pressure 0.5
    other = worker("other", kv_usage=0.95)
    for weights in (WEIGHTS, ScoringSettings(host_bandwidth_bytes_per_s=0)):
        scores = score_candidates(request, facts_of([host, other]), weights)
        holder, copying = scores.breakdown(0), scores.breakdown(1)
        assert holder.memory_penalty == pytest.approx(0.5 * 1000)
        assert (holder.copied_tokens, holder.copy_penalty) == (0, 0.0)
        assert copying.copied_tokens == 600
        assert copying.memory_penalty + copying.copy_penalty == pytest.approx(0.5 * 1000)
        assert holder.score - copying.score == pytest.approx(600 * hit_value(Tier.HOST, weights))


def test_only_a_believed_eligible_holder_makes_a_copy() -> None:
    request = RequestFacts(prompt_tokens=1000)
    other = worker("other", kv_usage=0.95)
    for holder in (
        worker("suspect", 600, kv_usage=0.95, suspect=True),
        worker("too-short", 600, kv_usage=0.95, max_model_len=500.0),
    ):
        scores = score_candidates(request, facts_of([holder, other]), WEIGHTS)
        assert scores.breakdown(1).copied_tokens == 0


def test_private_tenants_pay_for_company_and_missing_labels() -> None:
    request = RequestFacts(prompt_tokens=1000, isolation="private", required_labels={"zone": "a"})
    crowded = score_worker(
        request, worker("x", other_tenants_running=2, labels={"zone": "a"}), WEIGHTS
    )
    assert crowded.tenant_penalty == 2 * WEIGHTS.co_residence_tokens
    elsewhere = score_worker(request, worker("y", labels={"zone": "b"}), WEIGHTS)
    assert elsewhere.tenant_penalty == WEIGHTS.missing_label_tokens
    shared = score_worker(RequestFacts(1000), worker("x", other_tenants_running=2), WEIGHTS)
    assert shared.tenant_penalty == 0.0


def test_dedicated_tenants_only_see_their_pool() -> None:
    request = RequestFacts(prompt_tokens=1000, isolation="dedicated", pool="gold")
    ranked = rank_workers(request, [worker("other", 1000), worker("mine", 0, pool="gold")])
    assert [r.worker_id for r in ranked] == ["mine"]
    no_pool = RequestFacts(prompt_tokens=1000, isolation="dedicated")
    assert rank_workers(no_pool, [worker("mine", pool="gold")]) == []


def test_no_worker_takes_a_prompt_over_its_max_model_len() -> None:
    short = worker("short", 1000, max_model_len=512)
    long = worker("long", max_model_len=2048)
    unknown = worker("unknown")
    for prompt, takers in ((512, ["short", "long", "unknown"]), (513, ["long", "unknown"])):
        ranked = rank_workers(RequestFacts(prompt_tokens=prompt), [short, long, unknown])
        assert sorted(r.worker_id for r in ranked) == sorted(takers)
    # Counted by another tokenizer than the engines', the prompt is held against none.
    otherwise = RequestFacts(prompt_tokens=4096, counted_as_engines=False)
    assert len(rank_workers(otherwise, [short, long, unknown])) == 3
    # A prompt whose rest is not tokenised yet is held to the most it can count.
    estimated = RequestFacts(prompt_tokens=500, prompt_tokens_at_most=600)
    assert sorted(r.worker_id for r in rank_workers(estimated, [short, long, unknown])) == [
        "long",
        "unknown",
    ]


def test_ties_are_broken_at_random_not_by_list_order() -> None:
    request = RequestFacts(prompt_tokens=512)
    picks = Counter(
        best(request, worker("a", 256), worker("b", 256), worker("c", 256), seed=seed)
        for seed in range(300)
    )
    assert set(picks) == {"a", "b", "c"}
    assert min(picks.values()) > 50


def test_the_breakdown_adds_up_and_the_cached_prefix_is_capped() -> None:
    request = RequestFacts(prompt_tokens=100)
    breakdown = score_worker(request, worker("a", 512, waiting_requests=1, kv_usage=1.0), WEIGHTS)
    assert breakdown.cached_tokens == 100
    assert breakdown.score == pytest.approx(
        breakdown.saved_tokens
        - breakdown.queue_penalty
        - breakdown.memory_penalty
        - breakdown.copy_penalty
        - breakdown.tenant_penalty
    )


def breakdown(worker_id: str, saved: float = 0.0, **penalties: float) -> ScoreBreakdown:
    return ScoreBreakdown(
        worker_id,
        cached_tokens=int(saved),
        saved_tokens=saved,
        queue_penalty=penalties.get("queue", 0.0),
        memory_penalty=penalties.get("memory", 0.0),
        tenant_penalty=penalties.get("tenant", 0.0),
        copy_penalty=penalties.get("copy", 0.0),
    )


def test_the_deciding_factor_is_the_term_that_set_the_winner_apart() -> None:
    assert deciding_factor([breakdown("a", 1000), breakdown("b", 200)]) == "cache"
    assert deciding_factor([breakdown("a"), breakdown("b", queue=1024)]) == "load"
    crowded = breakdown("b", 1000, queue=2048)._replace(spilled=True)
    assert deciding_factor([breakdown("a"), crowded]) == "spill"
    assert deciding_factor([breakdown("a"), breakdown("b", memory=300)]) == "memory"
    assert deciding_factor([breakdown("a"), breakdown("b", copy=300)]) == "copy"
    assert deciding_factor([breakdown("a"), breakdown("b", tenant=2048)]) == "tenant"
    # The cache lead outweighs the load handicap that went against it.
    assert deciding_factor([breakdown("a", 3000, queue=1024), breakdown("b")]) == "cache"
    # The largest margin wins even when another term also favoured the winner.
    both = [breakdown("a", 100), breakdown("b", queue=2048)]
    assert deciding_factor(both) == "load"


def test_the_deciding_factor_without_a_contest() -> None:
    assert deciding_factor([]) == "none"
    assert deciding_factor([breakdown("a", 500)]) == "only_choice"
    assert deciding_factor([breakdown("a", 500), breakdown("b", 500)]) == "tie"
    third_only = [breakdown("a"), breakdown("b"), breakdown("c", queue=100)]
    assert deciding_factor(third_only) == "tie"  # only the runner-up counts


def test_the_deciding_factor_of_a_real_ranking() -> None:
    request = RequestFacts(prompt_tokens=2048)
    ranked = rank_workers(request, [worker("cold"), worker("hot", 1024)])
    assert [r.worker_id for r in ranked] == ["hot", "cold"]
    scores = score_candidates(request, facts_of([worker("cold"), worker("hot", 1024)]), WEIGHTS)
    columns = rank_by_score(scores, np.random.default_rng(0))
    assert [columns.worker_id(position) for position in range(2)] == ["hot", "cold"]
    assert deciding_factor(ranked) == "cache"


def test_running_requests_are_a_light_penalty() -> None:
    request = RequestFacts(prompt_tokens=1000)
    decoding = score_worker(request, worker("a", running_requests=3), WEIGHTS)
    assert decoding.queue_penalty == 3 * WEIGHTS.running_request_tokens
    assert best(request, worker("a", running_requests=3), worker("b", running_requests=1)) == "b"
    # Lighter than a cached prefix worth more than the decoding requests' weight.
    hot = worker("hot", 256, running_requests=3)
    assert best(request, hot, worker("idle")) == "hot"


def test_a_suspect_workers_cached_prefix_saves_nothing() -> None:
    request = RequestFacts(prompt_tokens=1000)
    suspect = score_worker(request, worker("a", 512, suspect=True), WEIGHTS)
    assert suspect.saved_tokens == 0.0
    assert suspect.cached_tokens == 512  # still reported as believed
    assert best(request, worker("a", 512, suspect=True), worker("b", 64)) == "b"


def test_a_workers_report_counts_with_the_requests_sent_since() -> None:
    reported = np.array([True, False])
    waiting, running = queue_estimate(
        reported,
        (np.array([2.0, 0.0]), np.array([1.0, 0.0])),
        sent_since_report=np.array([3.0, 0.0]),
        in_flight=np.array([5.0, 4.0]),
        prefilling=np.array([3.0, 1.0]),
    )
    # Reported: 2 waiting + 3 sent since; running: this router's 2 decoding > 1 reported.
    # Not reported: this router's own, 1 before its first byte and 3 after.
    assert waiting.tolist() == [5.0, 1.0]
    assert running.tolist() == [2.0, 3.0]


tokens = st.integers(min_value=0, max_value=4096)
worker_facts = st.builds(
    WorkerFacts,
    worker_id=st.text("abcdef", min_size=1, max_size=4),
    matched_tokens=st.dictionaries(st.sampled_from(list(Tier)), tokens, max_size=4),
    waiting_requests=st.integers(0, 50),
    running_requests=st.integers(0, 50),
    queued_prefill_tokens=tokens,
    kv_usage=st.floats(0.0, 1.0),
    evicted_share=st.floats(0.0, 1.0),
    other_tenants_running=st.integers(0, 20),
    labels=st.dictionaries(st.sampled_from(["zone", "gpu"]), st.sampled_from(["a", "b"])),
    pool=st.sampled_from([None, "gold", "silver"]),
    suspect=st.booleans(),
    max_model_len=st.sampled_from([np.inf, 1024.0, 8192.0]),
)
requests = st.builds(
    RequestFacts,
    prompt_tokens=st.integers(1, 8192),
    isolation=st.sampled_from(["shared", "private", "dedicated"]),
    required_labels=st.dictionaries(st.sampled_from(["zone", "gpu"]), st.sampled_from(["a", "b"])),
    pool=st.sampled_from([None, "gold"]),
)


@given(requests, st.lists(worker_facts, min_size=1, max_size=12))
def test_a_fleet_scored_at_once_scores_each_worker_as_alone(
    request: RequestFacts, workers: list[WorkerFacts]
) -> None:
    # The spill compares each worker with the others: off here. So does the copy term,
    # which takes its share of the memory penalty: at equal weights the two add up to
    # what the worker pays alone.
    weights = WEIGHTS.model_copy(update={"spill_margin_requests": 0.0})
    together = score_candidates(request, facts_of(workers), weights)
    for row, one in enumerate(workers):
        alone = score_worker(request, one, weights)
        scored = together.breakdown(row)
        merged = scored._replace(
            memory_penalty=scored.memory_penalty + scored.copy_penalty,
            copy_penalty=0.0,
            copied_tokens=0,
        )
        assert merged == pytest.approx(alone)
    ranked = rank_workers(request, workers)
    # Best first, and exactly the eligible workers.
    assert [b.score for b in ranked] == sorted((b.score for b in ranked), reverse=True)
    eligible = [
        w
        for w in workers
        if (request.isolation != "dedicated" or (request.pool and w.pool == request.pool))
        and request.prompt_tokens <= w.max_model_len
    ]
    assert len(ranked) == len(eligible)


@given(
    st.lists(st.tuples(st.integers(0, 12), st.booleans(), st.booleans()), min_size=1, max_size=16),
    st.sampled_from([1.0, 4.0, 8.0]),
    st.sampled_from([1.0, 1.5, 3.0]),
)
@example([(6, True, True)] + [(0, True, True)] * 5, 4.0, 1.5)  # just past a light fleet's gate
def test_the_spill_is_each_worker_past_its_peers_gate_by_the_definition(
    rows: list[tuple[int, bool, bool]], margin: float, ratio: float
) -> None:
    # The definition, one worker at a time: its peers are the eligible workers whose
    # load is known as its own is; past max(mean + margin, mean * ratio) of theirs, it
    # carries its requests over that mean. (spill_excess settles light fleets by one
    # comparison: this holds it to the definition there too.)
    load = np.array([float(count) for count, _, _ in rows])
    allowed = np.array([eligible for _, eligible, _ in rows])
    reported = np.array([known for _, _, known in rows])
    weights = WEIGHTS.model_copy(
        update={"spill_margin_requests": margin, "spill_load_ratio": ratio}
    )
    expected = []
    for count, eligible, known in rows:
        peers = [
            float(other)
            for other, peer_eligible, peer_known in rows
            if peer_eligible and peer_known == known
        ]
        mean = sum(peers) / len(peers) if peers else 0.0
        gate = max(mean + margin, mean * ratio)
        expected.append(count - mean if eligible and count > gate else 0.0)
    excess = spill_excess(load, allowed, reported, weights)
    assert excess.tolist() == pytest.approx(expected)
