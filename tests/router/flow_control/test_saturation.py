"""Room in a model's engines, from their reports and the router's own traffic."""

from __future__ import annotations

import math

import numpy as np

from router.flow_control.saturation import (
    UNBOUNDED,
    BatchLimit,
    EngineQueues,
    learnt_batch_limit,
    room,
    would_wait,
)


def queues(
    *,
    running: list[float],
    waiting: list[float],
    since: list[float],
    limit: list[float],
    kv: list[float] | None = None,
    reported: list[bool] | None = None,
    in_flight: list[float] | None = None,
) -> EngineQueues:
    count = len(running)
    return EngineQueues(
        reported=np.array(reported or [True] * count, dtype=np.bool_),
        running=np.array(running, dtype=float),
        waiting=np.array(waiting, dtype=float),
        traffic_since_report=np.array(since, dtype=float),
        batch_limit=np.array(limit, dtype=float),
        kv_usage=np.array(kv or [0.0] * count),
        in_flight=np.array(in_flight or [0.0] * count),
    )


def test_an_engine_holds_its_report_plus_the_routers_traffic_since_beyond_its_batch() -> None:
    full = queues(running=[4, 4], waiting=[1, 0], since=[2, -1], limit=[4, 4])
    # Two waiting allowed: the first holds one over that, the second runs one more (the
    # router's request that ended freed it) and queues two: net, two.
    assert room(full, 2, 1.0) == 2
    assert room(full, 0, 1.0) == 0  # the first's queue takes the second's one free place


def test_the_replicas_requests_in_flight_count_where_the_report_lags_behind_them() -> None:
    lagging = queues(running=[1], waiting=[0], since=[0], limit=[4], in_flight=[5])
    assert room(lagging, 2, 1.0) == 1  # 5 held (the report says 1): 4 run, 2 may wait
    assert room(queues(running=[3], waiting=[0], since=[0], limit=[4], in_flight=[1]), 0, 1.0) == 1


def test_a_full_kv_cache_takes_nothing_and_an_unlearnt_limit_is_unbounded() -> None:
    assert room(queues(running=[1], waiting=[0], since=[0], limit=[4], kv=[0.99]), 2, 0.98) == 0
    # At 1.0 the KV use decides nothing: the engine queues what does not fit.
    assert room(queues(running=[1], waiting=[0], since=[0], limit=[4], kv=[1.0]), 2, 1.0) == 5
    unknown = queues(running=[1, 4], waiting=[0, 3], since=[0, 0], limit=[math.inf, 4])
    assert room(unknown, 2, 1.0) == UNBOUNDED
    unreported = queues(running=[0], waiting=[0], since=[0], limit=[4], reported=[False])
    assert room(unreported, 2, 1.0) == UNBOUNDED
    assert room(queues(running=[], waiting=[], since=[], limit=[]), 2, 1.0) == 0


def test_the_batch_limit_is_the_most_run_while_requests_waited_and_never_falls() -> None:
    def after(*reports: tuple[int, int]) -> float:
        learnt = BatchLimit()
        for running, waiting in reports:
            learnt = learnt_batch_limit(learnt, running, waiting)
        return learnt.limit

    assert after((3, 0)) == math.inf
    assert after((3, 2)) == math.inf  # one report: the waiting may have just arrived
    assert after((3, 2), (5, 0)) == math.inf  # they had: the engine ran them
    assert after((3, 2), (5, 0), (5, 1)) == math.inf
    assert after((3, 2), (5, 1)) == 5.0  # two in a row: the batch was full
    assert after((5, 2), (3, 1)) == 5.0  # the most of the two
    assert after((3, 2), (3, 2), (5, 0)) == 5.0
    assert after((5, 2), (5, 2), (2, 1)) == 5.0  # held back by KV memory: those wait
    assert after((5, 2), (5, 2), (7, 1)) == 7.0
    assert after((5, 2), (5, 2), (0, 4)) == 5.0  # nothing ran: nothing learnt
    assert after((0, 4), (3, 2)) == math.inf  # nothing ran: no evidence of a batch


def test_a_request_would_wait_where_its_engines_batch_is_full() -> None:
    engines = queues(running=[4, 3, 1], waiting=[0, 0, 0], since=[0, 0, 0], limit=[4, 4, math.inf])
    assert would_wait(engines).tolist() == [True, False, False]
