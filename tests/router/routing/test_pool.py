"""The pool: which workers requests may go to now, and this router's traffic to them."""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvplane.core.types import EventsState, LoadReport, ReplayState, WiringReport, WorkerInfo
from router.control_plane.workers import WorkerView
from router.index.base import LocationIndexError, WorkerState
from router.index.memory import MemoryLocationIndex
from router.index.redis import RedisLocationIndex
from router.routing.accuracy import PredictionAccuracy
from router.routing.evictions import RecentEvictions
from router.routing.pool import Ticket, WorkerPool
from tests.clock import ManualClock
from tests.redis_servers import stoppable_redis

MODEL = "test-model"

LEASE_S = 10.0
BACKOFF_S = 2.0


def worker(worker_id: str, incarnation: int = 1, **fields: Any) -> WorkerInfo:
    return WorkerInfo(
        **{
            "worker_id": worker_id,
            "incarnation": incarnation,
            "base_url": "http://127.0.0.1:8000",
            "model": MODEL,
            "block_size": 4,
            **fields,
        }
    )


class Setup:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.index = MemoryLocationIndex(clock=self.clock)
        self.view = WorkerView()
        self.pool = WorkerPool(
            self.index,
            self.view,
            evictions=RecentEvictions(horizon_s=10.0),
            accuracy=PredictionAccuracy(suspect_after_misses=2, tolerance_tokens=4),
            unreachable_backoff_s=BACKOFF_S,
            clock=self.clock,
        )

    async def register(self, worker_id: str, incarnation: int = 1, **fields: Any) -> None:
        info = worker(worker_id, incarnation, **fields)
        await self.index.register(info, LEASE_S)
        self.view.registered(info, stream=1, now=self.clock.now, lease_s=LEASE_S, applied=0)

    def ids(self, model: str | None = None) -> list[str]:
        return sorted(c.worker_id for c in self.pool.candidates(model))


def load(**fields: Any) -> LoadReport:
    return LoadReport(**{"running": 0, "waiting": 0, "kv_usage": 0.0, "timestamp_ms": 0, **fields})


async def test_nothing_is_a_candidate_before_the_first_refresh() -> None:
    setup = Setup()
    await setup.register("w1")
    assert setup.ids() == []
    assert setup.pool.refreshed_at is None
    await setup.pool.refresh()
    assert setup.ids() == ["w1"]
    assert setup.pool.refreshed_at == setup.clock.now
    status = setup.pool.status("w1")
    assert status is not None
    assert status.state is WorkerState.LIVE
    assert [s.info.worker_id for s in setup.pool.statuses()] == ["w1"]


async def test_candidates_are_filtered_by_model() -> None:
    setup = Setup()
    await setup.register("a")
    await setup.register("b", model="other-model")
    await setup.pool.refresh()
    assert setup.ids(MODEL) == ["a"]
    assert setup.ids("other-model") == ["b"]
    assert setup.ids("missing") == []
    assert setup.ids() == ["a", "b"]
    assert setup.pool.models() == sorted([MODEL, "other-model"])


async def test_dead_and_draining_workers_in_the_index_are_not_candidates() -> None:
    setup = Setup()
    await setup.register("live")
    await setup.register("draining")
    await setup.index.renew("draining", 1, LEASE_S, draining=True)
    await setup.register("short")
    await setup.index.renew("short", 1, 1.0)
    setup.clock.now += 5.0  # "short" has run out of lease
    await setup.pool.refresh()
    assert setup.ids() == ["live"]


async def test_deaths_and_drains_this_router_saw_count_before_the_next_refresh() -> None:
    setup = Setup()
    for worker_id in ("a", "b", "c"):
        await setup.register(worker_id)
    await setup.pool.refresh()
    setup.view.dead("a", setup.clock.now)
    setup.view.renewed("b", 1, now=setup.clock.now, lease_s=LEASE_S, draining=True)
    assert setup.ids() == ["c"]


async def test_this_routers_view_of_an_older_incarnation_is_ignored() -> None:
    setup = Setup()
    await setup.register("w1", incarnation=1)
    setup.view.load("w1", 1, load(running=3), setup.clock.now)
    setup.view.dead("w1", setup.clock.now)
    # The worker came back through another router replica: only the index knows.
    await setup.index.register(worker("w1", 2), LEASE_S)
    await setup.pool.refresh()
    (candidate,) = setup.pool.candidates()
    assert candidate.info.incarnation == 2
    assert candidate.load is None


async def test_an_operators_drain_removes_a_worker_until_undone() -> None:
    setup = Setup()
    await setup.register("a")
    await setup.register("b")
    await setup.pool.refresh()
    setup.pool.drain("a", drained=True)
    assert setup.ids() == ["b"]
    assert setup.pool.drained == {"a"}
    setup.pool.drain("a", drained=False)
    assert setup.ids() == ["a", "b"]


async def test_a_candidate_carries_its_last_load_report() -> None:
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    (candidate,) = setup.pool.candidates()
    assert candidate.load is None
    report = load(running=2, waiting=1, kv_usage=0.5)
    setup.view.load("w1", 1, report, setup.clock.now)
    (candidate,) = setup.pool.candidates()
    assert candidate.load == report


async def test_a_worker_whose_engine_is_down_is_not_a_candidate() -> None:
    setup = Setup()
    await setup.register("a")
    await setup.register("b")
    await setup.pool.refresh()
    setup.view.load("a", 1, load(engine_down=True), setup.clock.now)
    assert setup.ids() == ["b"]
    setup.view.load("a", 1, load(), setup.clock.now)  # the engine is back
    assert setup.ids() == ["a", "b"]


async def test_an_unreachable_worker_sits_out_for_the_backoff() -> None:
    setup = Setup()
    await setup.register("a")
    await setup.register("b")
    await setup.pool.refresh()
    setup.pool.unreachable("a")
    assert setup.ids() == ["b"]
    setup.clock.now += BACKOFF_S - 0.1
    assert setup.ids() == ["b"]
    setup.clock.now += 0.1
    assert setup.ids() == ["a", "b"]


async def test_traffic_counts_a_request_until_its_first_byte_and_its_end() -> None:
    setup = Setup()
    traffic = setup.pool.traffic("w1")
    ticket = setup.pool.sent("w1", "acme", prefill_tokens=300)
    setup.pool.sent("w1", "globex", prefill_tokens=200)
    assert (traffic.in_flight, traffic.prefilling, traffic.prefill_tokens) == (2, 2, 500)
    assert traffic.by_tenant == Counter({"acme": 1, "globex": 1})
    setup.pool.first_byte(ticket)
    setup.pool.first_byte(ticket)  # counted once
    assert (traffic.in_flight, traffic.prefilling, traffic.prefill_tokens) == (2, 1, 200)
    setup.pool.finished(ticket)
    assert (traffic.in_flight, traffic.prefilling, traffic.prefill_tokens) == (1, 1, 200)
    assert traffic.by_tenant == Counter({"globex": 1})


async def test_requests_before_their_first_byte_are_told_apart_by_when_sent() -> None:
    setup = Setup()
    early = setup.pool.sent("w1", "acme", prefill_tokens=10)
    setup.clock.now += 1.0
    late = setup.pool.sent("w1", "acme", prefill_tokens=10)
    traffic = setup.pool.traffic("w1")
    assert late.sent_at - early.sent_at == 1.0
    assert traffic.prefilling_sent_after(early.sent_at - 0.5) == 2
    assert traffic.prefilling_sent_after(early.sent_at + 0.5) == 1
    setup.pool.first_byte(late)
    assert traffic.prefilling_sent_after(early.sent_at + 0.5) == 0
    assert traffic.prefilling == 1


async def test_requests_sent_after_a_moment_are_counted_as_a_full_count_would() -> None:
    """The count is kept up to date as requests come and go, and made again when the
    moment moves: it must always equal counting every request before its first byte."""
    setup = Setup()
    rng = random.Random(7)
    traffic = setup.pool.traffic("w1")
    tickets: list[Ticket] = []
    moment = 0.0
    for _ in range(2000):
        action = rng.random()
        if action < 0.4 or not tickets:
            tickets.append(setup.pool.sent("w1", "acme", prefill_tokens=1))
        elif action < 0.6:
            setup.pool.first_byte(rng.choice(tickets))
        elif action < 0.8:
            setup.pool.finished(tickets.pop(rng.randrange(len(tickets))))
        else:
            moment = setup.clock.now - rng.choice([0.0, 0.5, 2.0, 5.0])  # a load report
        setup.clock.now += rng.choice([0.0, 0.25, 1.0])
        expected = sum(1 for t in tickets if t.prefilling and t.sent_at > moment)
        assert traffic.prefilling_sent_after(moment) == expected


async def test_finishing_without_a_first_byte_releases_everything() -> None:
    setup = Setup()
    tickets = [setup.pool.sent("w1", "acme", prefill_tokens=100) for _ in range(3)]
    for ticket in tickets:
        setup.pool.finished(ticket)
    traffic = setup.pool.traffic("w1")
    assert (traffic.in_flight, traffic.prefilling, traffic.prefill_tokens) == (0, 0, 0)
    assert traffic.by_tenant == Counter()
    assert "acme" not in traffic.by_tenant


async def test_candidates_share_the_fleets_live_traffic_record() -> None:
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    setup.pool.sent("w1", "acme", prefill_tokens=64)
    (candidate,) = setup.pool.candidates()
    assert candidate.traffic.in_flight == 1
    assert candidate.traffic.by_tenant == Counter({"acme": 1})


async def test_while_the_index_is_silent_the_last_registry_read_stands() -> None:
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    setup.view.dead("w1", setup.clock.now)  # e.g. its lease ran out in this router's view
    assert setup.ids() == []
    setup.clock.now += 5  # no refresh since: the index is not answering
    assert not setup.pool.registry_is_current()
    assert setup.ids() == ["w1"]


async def test_a_registry_read_that_fails_makes_the_views_deaths_guesses_at_once(
    tmp_path: Path,
) -> None:
    """Within the stale window too: the view's leases (renewed a third of a lease apart
    at most) may run out before a last good read is a second old."""
    clock = ManualClock()
    view = WorkerView()
    with stoppable_redis(tmp_path) as (url, redis_process):
        index = RedisLocationIndex.from_url(url, prefix="fleet-test")
        pool = WorkerPool(
            index,
            view,
            evictions=RecentEvictions(horizon_s=10.0),
            accuracy=PredictionAccuracy(suspect_after_misses=2, tolerance_tokens=4),
            unreachable_backoff_s=BACKOFF_S,
            clock=clock,
        )
        info = worker("w1")
        await index.register(info, LEASE_S)
        view.registered(info, stream=1, now=clock.now, lease_s=LEASE_S, applied=0)
        await pool.refresh()
        view.dead("w1", clock.now)  # its lease ran out in this router's view
        assert [c.worker_id for c in pool.candidates()] == []
        redis_process.stop()
        with pytest.raises(LocationIndexError):
            await pool.refresh()
        assert not pool.registry_is_current()  # no time has passed on the clock
        assert [c.worker_id for c in pool.candidates()] == ["w1"]
        await index.close()


async def test_evictions_are_a_share_of_the_capacity_in_router_blocks() -> None:
    """Removals are counted in router blocks (4 tokens here); an engine registers its
    capacity in its own blocks, which may be one token each (SGLang's pages)."""
    setup = Setup()
    await setup.register("pages", kv_capacity_blocks=400)  # 400 one-token pages
    await setup.register("blocks", kv_capacity_blocks=100)  # 100 blocks of 4 tokens
    await setup.register("silent", kv_capacity_blocks=100)  # says no block size
    await setup.register("liar", kv_capacity_blocks=100)  # says 64: it does not divide 4
    await setup.pool.refresh()
    pool, clock = setup.pool, setup.clock
    sizes = (("pages", 1), ("blocks", 4), ("silent", None), ("liar", 64))
    for worker_id, engine_block_size in sizes:
        wiring = WiringReport(EventsState.FLOWING, ReplayState.OK, engine_block_size)
        setup.view.load(worker_id, 1, load(wiring=wiring), clock.now)
        pool.evictions.record(worker_id, 50, clock.now)  # 200 tokens' worth
    rows = pool.candidate_rows()
    facts = pool.facts(pool.roster, rows, None, clock.now)
    shares = dict(zip(facts.worker_ids, facts.evicted_share.tolist(), strict=True))
    # 400 tokens of cache each: 100 router blocks, half of them evicted. A size that
    # does not divide the router's cannot be an engine's it keys: the count stands.
    assert shares == {"pages": 0.5, "blocks": 0.5, "silent": 0.5, "liar": 0.5}


async def test_a_non_streamed_request_prefills_until_the_next_load_report() -> None:
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    streamed = setup.pool.sent("w1", "acme", prefill_tokens=100)
    unstreamed = setup.pool.sent("w1", "acme", prefill_tokens=500, streamed=False)
    setup.clock.now += 0.5
    setup.pool.candidates()
    assert setup.pool.traffic("w1").prefill_tokens == 600  # no report since: both count
    setup.view.load("w1", 1, load(running=2), setup.clock.now)
    (candidate,) = setup.pool.candidates()
    # The engine's report covers the silent, non-streamed one; the stream still counts
    # until its first byte.
    assert candidate.traffic.prefill_tokens == 100
    assert candidate.traffic.prefilling == 1
    setup.pool.finished(unstreamed)
    setup.pool.finished(streamed)
    traffic = setup.pool.traffic("w1")
    assert (traffic.in_flight, traffic.prefill_tokens, traffic.prefilling) == (0, 0, 0)
    assert not traffic.unstreamed


async def test_the_facts_read_every_source_as_it_stands_now() -> None:
    setup = Setup()
    await setup.register("w1", kv_capacity_blocks=100)
    await setup.register("w2", kv_capacity_blocks=0)  # capacity unknown
    await setup.pool.refresh()
    pool, clock = setup.pool, setup.clock
    before = pool.sent("w1", "acme", prefill_tokens=300)  # sent before the report
    clock.now += 1.0
    setup.view.load("w1", 1, load(waiting=2, running=1, kv_usage=0.5), clock.now)
    clock.now += 1.0
    pool.sent("w1", "globex", prefill_tokens=200)  # sent after it
    pool.sent("w2", "acme", prefill_tokens=50)
    pool.evictions.record("w1", 50, clock.now)
    pool.evictions.record("w2", 50, clock.now)
    for _ in range(2):  # two stale predictions in a row: suspect
        pool.accuracy.observe("w2", 1, predicted_tokens=64, reported_tokens=0)

    rows = pool.candidate_rows()
    facts = pool.facts(pool.roster, rows, "acme", clock.now)
    assert not pool.facts(pool.roster, rows, None, clock.now).other_tenants_running.any()
    by_id = {worker_id: row for row, worker_id in enumerate(facts.worker_ids)}
    w1, w2 = by_id["w1"], by_id["w2"]
    # w1 reported 2 waiting; one request was sent since, one before (which it counted).
    assert facts.waiting_requests[w1] == 3
    assert facts.running_requests[w1] == 1
    assert facts.queued_prefill_tokens[w1] == 500
    assert facts.kv_usage[w1] == 0.5
    assert facts.evicted_share[w1] == 0.5
    assert facts.other_tenants_running[w1] == 1  # globex's, not acme's own
    assert not facts.suspect[w1]
    # w2 sent no report: this router's own request waits for its first byte.
    assert (facts.waiting_requests[w2], facts.running_requests[w2]) == (1, 0)
    assert facts.evicted_share[w2] == 0.0  # no capacity, no share
    assert facts.other_tenants_running[w2] == 0
    assert facts.suspect[w2]
    # Each change shows at once: the first byte of the request sent before the report.
    pool.first_byte(before)
    facts = pool.facts(pool.roster, pool.candidate_rows(), "acme", clock.now)
    assert facts.queued_prefill_tokens[w1] == 200
    assert facts.waiting_requests[w1] == 3  # it was not counted on top of the report


async def test_a_new_incarnation_in_the_registry_starts_a_new_row() -> None:
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    setup.view.load("w1", 1, load(waiting=7), setup.clock.now)
    roster = setup.pool.roster
    assert roster.report_waiting[roster.position["w1"]] == 7
    await setup.index.register(worker("w1", 2), LEASE_S)  # through another replica
    await setup.pool.refresh()
    assert setup.pool.roster is not roster
    row = setup.pool.roster.position["w1"]
    assert setup.pool.roster.infos[row].incarnation == 2
    assert not setup.pool.roster.reported[row]  # incarnation 1's report does not count


async def test_a_handed_off_request_counts_until_its_workers_next_report() -> None:
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    setup.view.load("w1", 1, load(), setup.clock.now)
    setup.clock.advance(0.1)
    ticket = setup.pool.sent("w1", "t", prefill_tokens=100)
    setup.pool.handed_off(ticket)
    assert setup.pool.roster.in_flight[0] == 1  # still this router's traffic
    setup.clock.advance(0.2)
    setup.view.load("w1", 1, load(running=1), setup.clock.now)  # the engine's count has it
    assert setup.pool.roster.in_flight[0] == 0
    setup.clock.advance(5.0)  # and the horizon ends nothing twice
    assert setup.pool.roster.in_flight[0] == 0
    assert setup.pool.traffic("w1").in_flight == 0


async def test_a_handed_off_request_ends_at_the_horizon_where_no_report_comes() -> None:
    # A replica the worker's agent does not stream to hears no report of it.
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    first = setup.pool.sent("w1", "t", prefill_tokens=100)
    setup.pool.handed_off(first)
    setup.clock.advance(0.6)
    second = setup.pool.sent("w1", "t", prefill_tokens=100)
    setup.pool.handed_off(second)
    assert setup.pool.roster.in_flight[0] == 2
    setup.clock.advance(0.5)  # the first is 1.1 s old: past the default 1 s
    assert setup.pool.roster.in_flight[0] == 1
    setup.clock.advance(0.5)
    assert setup.pool.roster.in_flight[0] == 0
    assert setup.pool.traffic("w1").handed_off == deque()
    assert setup.pool.traffic("w1").prefill_tokens == 0


async def test_a_new_roster_keeps_what_the_reports_read_so_far_taught() -> None:
    # A worker joining rebuilds the roster: the last report of those already there is
    # not read again, as a second report in a row, with what is in flight now.
    setup = Setup()
    await setup.register("w1")
    await setup.pool.refresh()
    sent = [setup.pool.sent("w1", "t", prefill_tokens=10) for _ in range(3)]
    setup.view.load("w1", 1, load(running=2, waiting=1), setup.clock.now)
    setup.pool.candidates()  # the report read

    def queues() -> tuple[float, float]:
        pool = setup.pool
        engine = pool.engine_queues(np.array([pool.row_of("w1")], dtype=np.intp))
        return float(engine.batch_limit[0]), float(engine.traffic_since_report[0])

    setup.pool.finished(sent[0])
    assert queues() == (math.inf, -1.0)  # one report with requests waiting proves nothing
    await setup.register("w2")
    await setup.pool.refresh()
    assert queues() == (math.inf, -1.0)


async def test_a_restarted_engines_batch_limit_is_learnt_afresh() -> None:
    # The limit only ever rises: learnt from the incarnation before, a larger batch
    # would let through more than the restarted engine runs.
    setup = Setup()

    def batch_limit() -> float:
        pool = setup.pool
        return float(
            pool.engine_queues(np.array([pool.row_of("w1")], dtype=np.intp)).batch_limit[0]
        )

    async def reports(incarnation: int, running: int) -> None:
        for _ in range(2):  # two in a row with requests waiting
            setup.clock.advance(1.0)
            setup.view.load("w1", incarnation, load(running=running, waiting=1), setup.clock.now)
            setup.pool.candidates()  # read

    await setup.register("w1")
    await setup.pool.refresh()
    await reports(1, running=8)
    assert batch_limit() == 8.0
    await setup.register("w1", 2)
    await setup.pool.refresh()
    assert batch_limit() == math.inf  # not known yet: nothing waits for it
    await reports(2, running=4)
    assert batch_limit() == 4.0
