"""Continuous batching: budgets, chunked prefill, waiting, preemption, priority
scheduling, timing input."""

from __future__ import annotations

import pytest

from simulations.engine_sim.block_hash import none_hash
from simulations.engine_sim.block_pool import BlockPool
from simulations.engine_sim.kv_cache_manager import KVCacheManager
from simulations.engine_sim.request import RequestStatus, SimRequest, priority_order
from simulations.engine_sim.scheduler import (
    RequestTooLarge,
    Scheduler,
    SchedulerLimits,
    sampler_over,
)
from simulations.engine_sim.timing import StepWork, TimingModel, step_seconds

BLOCK = 4


def make_scheduler(
    num_blocks: int, max_seqs: int = 8, max_tokens: int = 64, policy: str = "fcfs"
) -> Scheduler[SimRequest]:
    manager = KVCacheManager(BlockPool(num_blocks), BLOCK)
    order = priority_order if policy == "priority" else None
    return Scheduler(
        manager, SchedulerLimits(max_seqs, max_tokens), sampler_over([7]), priority_order=order
    )


def request(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    first: int = 0,
    *,
    priority: int = 0,
    arrival: float = 0.0,
) -> SimRequest:
    return SimRequest(
        request_id,
        list(range(first, first + prompt_len)),
        max_tokens,
        BLOCK,
        none_hash(),
        arrival_time=arrival,
        priority=priority,
    )


def run_to_end(scheduler: Scheduler[SimRequest]) -> int:
    steps = 0
    while scheduler.has_work:
        step = scheduler.schedule()
        assert not step.is_empty
        scheduler.finish_step(step)
        steps += 1
    return steps


def test_one_token_per_decode_step_and_the_request_finishes() -> None:
    scheduler = make_scheduler(16)
    req = request("a", 6, 3)
    scheduler.add(req)
    assert run_to_end(scheduler) == 3  # prefill (with the first token), then 2 decodes
    assert req.output_token_ids == [7, 7, 7]
    assert req.status is RequestStatus.FINISHED
    assert scheduler.kv_cache.pool.num_free_blocks == 16


def test_long_prompts_are_prefilled_in_chunks_within_the_token_budget() -> None:
    scheduler = make_scheduler(64, max_tokens=16)
    req = request("a", 40, 1)
    scheduler.add(req)
    budgets = []
    while scheduler.has_work:
        step = scheduler.schedule()
        budgets.append(step.tokens[req])
        scheduler.finish_step(step)
    assert budgets == [16, 16, 8]


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    scheduler = make_scheduler(64, max_seqs=2)
    for index in range(3):
        scheduler.add(request(str(index), 4, 2, first=100 * index))
    step = scheduler.schedule()
    assert len(step.tokens) == 2
    assert len(scheduler.waiting) == 1


def test_a_request_that_does_not_fit_waits_and_runs_when_memory_frees() -> None:
    scheduler = make_scheduler(4)
    big = request("big", 12, 2)
    other = request("other", 12, 2, first=100)
    scheduler.add(big)
    scheduler.add(other)
    step = scheduler.schedule()
    assert list(step.tokens) == [big]  # 3 of 4 blocks taken; the other waits
    assert other.status is RequestStatus.WAITING
    run_to_end(scheduler)
    assert other.status is RequestStatus.FINISHED


def test_running_out_of_blocks_preempts_the_last_admitted_request() -> None:
    scheduler = make_scheduler(4)
    first = request("first", 8, 6)  # grows from 2 to 4 blocks
    second = request("second", 8, 6, first=100)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.finish_step(scheduler.schedule())  # both admitted, 2 blocks each
    step = scheduler.schedule()  # both need a third block: the second is preempted
    assert step.num_preempted == 1
    assert second.status is RequestStatus.PREEMPTED
    assert second.num_computed_tokens == 0
    assert scheduler.waiting[0] is second
    run_to_end(scheduler)
    assert first.status is second.status is RequestStatus.FINISHED
    assert len(second.output_token_ids) == 6
    assert scheduler.num_preemptions >= 1


def test_priority_scheduling_orders_the_waiting_queue_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(64, max_seqs=1, policy="priority")
    for arrival, (name, priority) in enumerate([("a", 3), ("b", 1), ("c", 1), ("d", -2)]):
        scheduler.add(request(name, 4, 1, first=10 * arrival, priority=priority, arrival=arrival))
    assert [queued.request_id for queued in scheduler.waiting] == ["d", "b", "c", "a"]
    served = []
    while scheduler.has_work:
        step = scheduler.schedule()
        served += [request.request_id for request in step.tokens]
        scheduler.finish_step(step)
    assert served == ["d", "b", "c", "a"]


@pytest.mark.parametrize(
    ("policy", "victim", "then_waiting"),
    [
        # The latest admitted goes, and waits first in line.
        ("fcfs", "urgent", ["urgent", "newer"]),
        # The largest (priority, arrival) goes, though scheduled first in the step, and
        # waits in its place.
        ("priority", "relaxed", ["newer", "relaxed"]),
    ],
)
def test_running_out_of_blocks_preempts_the_policys_victim(
    policy: str, victim: str, then_waiting: list[str]
) -> None:
    scheduler = make_scheduler(7, policy=policy)
    relaxed = request("relaxed", 8, 10, priority=5)
    urgent = request("urgent", 9, 10, first=100, priority=0, arrival=1.0)
    scheduler.add(relaxed)
    scheduler.finish_step(scheduler.schedule())
    scheduler.add(urgent)  # admitted after `relaxed`, so behind it in the running batch
    for _ in range(4):
        step = scheduler.schedule()
        assert not step.num_preempted
        scheduler.finish_step(step)
    step = scheduler.schedule()  # both need a fourth block, and one is free
    preempted, kept = (relaxed, urgent) if victim == "relaxed" else (urgent, relaxed)
    assert step.num_preempted == 1
    assert preempted.status is RequestStatus.PREEMPTED
    assert step.tokens == {kept: 1}
    assert step.work == StepWork(decode_requests=1, decode_context_tokens=kept.num_tokens)
    scheduler.add(request("newer", 4, 1, first=200, priority=0, arrival=2.0))
    assert [queued.request_id for queued in scheduler.waiting] == then_waiting
    scheduler.finish_step(step)
    run_to_end(scheduler)
    assert relaxed.status is urgent.status is RequestStatus.FINISHED


def test_cached_tokens_are_counted_once_and_skip_prefill() -> None:
    scheduler = make_scheduler(16)
    scheduler.add(request("a", 10, 1))
    run_to_end(scheduler)
    again = request("b", 10, 1)
    scheduler.add(again)
    step = scheduler.schedule()
    assert again.num_cached_tokens == 8
    assert step.work == StepWork(prefill_tokens=2)


def test_the_last_prompt_token_alone_is_still_prefill() -> None:
    scheduler = make_scheduler(16)
    scheduler.add(request("a", 9, 1))
    run_to_end(scheduler)
    again = request("b", 9, 1)
    scheduler.add(again)
    step = scheduler.schedule()
    assert again.num_cached_tokens == 8
    assert step.work == StepWork(prefill_tokens=1)  # one token, but of the prompt


def test_a_request_that_could_never_fit_is_refused_up_front() -> None:
    scheduler = make_scheduler(4)
    with pytest.raises(RequestTooLarge, match="needs 5 KV blocks but the cache has 4"):
        scheduler.add(request("huge", 16, 4))
    assert not scheduler.has_work


def test_step_time_grows_with_uncached_tokens_and_decode_context() -> None:
    model = TimingModel(
        prefill_ms_per_token=1.0,
        prefill_overhead_ms=5.0,
        decode_step_ms=2.0,
        decode_ms_per_context_token=0.5,
    )
    assert step_seconds(model, StepWork()) == 0.0
    assert step_seconds(model, StepWork(prefill_tokens=10)) == 0.015
    assert step_seconds(model, StepWork(decode_requests=2, decode_context_tokens=8)) == 0.006
