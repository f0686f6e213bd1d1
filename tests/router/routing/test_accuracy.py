"""Prediction accuracy: engines' cached-token reports judged against the router's belief."""

from __future__ import annotations

import random

import pytest

from router.routing.accuracy import JUDGED_WINDOW, PredictionAccuracy, Verdict, judge
from tests.clock import ManualClock

TOLERANCE = 16


@pytest.mark.parametrize(
    ("predicted", "reported", "verdict"),
    [
        (128, 128, Verdict.CONFIRMED),
        (128, 112, Verdict.CONFIRMED),  # one block short: within tolerance
        (128, 144, Verdict.CONFIRMED),
        (128, 111, Verdict.STALE),
        (128, 0, Verdict.STALE),
        (128, 145, Verdict.BETTER),
        (0, 0, Verdict.CONFIRMED),
        (0, 64, Verdict.BETTER),
    ],
)
def test_judge_allows_one_block_either_way(predicted: int, reported: int, verdict: Verdict) -> None:
    assert judge(predicted, reported, TOLERANCE) is verdict


def test_a_worker_is_suspect_after_enough_stale_predictions_in_a_row() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=3, tolerance_tokens=TOLERANCE)
    for _ in range(2):
        assert accuracy.observe("w1", 1, 128, 0) is Verdict.STALE
    assert not accuracy.is_suspect("w1", 1)
    assert accuracy.suspects() == set()
    accuracy.observe("w1", 1, 128, 0)
    assert accuracy.is_suspect("w1", 1)
    assert accuracy.suspects() == {"w1"}


def test_a_confirmation_between_misses_restarts_the_count() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=2, tolerance_tokens=TOLERANCE)
    accuracy.observe("w1", 1, 128, 0)
    accuracy.observe("w1", 1, 128, 128)
    accuracy.observe("w1", 1, 128, 0)
    assert not accuracy.is_suspect("w1", 1)


def test_a_confirmed_prediction_of_something_clears_a_suspicion() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=2, tolerance_tokens=TOLERANCE)
    accuracy.observe("w1", 1, 128, 0)
    accuracy.observe("w1", 1, 128, 0)
    assert accuracy.is_suspect("w1", 1)
    assert accuracy.observe("w1", 1, 64, 64) is Verdict.CONFIRMED
    assert not accuracy.is_suspect("w1", 1)
    assert accuracy.suspects() == set()


def test_a_confirmed_prediction_of_nothing_does_not_clear_a_suspicion() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=2, tolerance_tokens=TOLERANCE)
    accuracy.observe("w1", 1, 128, 0)
    accuracy.observe("w1", 1, 128, 0)
    assert accuracy.observe("w1", 1, 0, 0) is Verdict.CONFIRMED
    assert accuracy.is_suspect("w1", 1)


def test_a_new_incarnation_starts_with_a_clean_record() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=2, tolerance_tokens=TOLERANCE)
    accuracy.observe("w1", 1, 128, 0)
    accuracy.observe("w1", 1, 128, 0)
    assert not accuracy.is_suspect("w1", 2)  # suspicion belongs to incarnation 1
    accuracy.observe("w1", 2, 128, 0)  # one miss of the new incarnation
    assert not accuracy.is_suspect("w1", 2)
    assert not accuracy.is_suspect("w1", 1)
    assert accuracy.suspects() == set()


def test_suspects_are_tracked_per_worker() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=1, tolerance_tokens=TOLERANCE)
    accuracy.observe("w1", 1, 128, 0)
    accuracy.observe("w2", 1, 128, 128)
    accuracy.observe("w3", 1, 128, 0)
    assert accuracy.suspects() == {"w1", "w3"}
    assert not accuracy.is_suspect("unknown", 1)


def test_misses_spaced_out_by_hits_still_make_a_worker_suspect() -> None:
    """Four stale predictions, one that holds, over and over: never five in a row, but
    half of the recent window is stale."""
    accuracy = PredictionAccuracy(suspect_after_misses=5, tolerance_tokens=TOLERANCE)
    for _ in range(3):
        for _ in range(4):
            accuracy.observe("w1", 1, 128, 0)
        accuracy.observe("w1", 1, 128, 128)
    assert not accuracy.is_suspect("w1", 1)  # under half a window judged: too few to tell
    for _ in range(4):
        accuracy.observe("w1", 1, 128, 0)
    accuracy.observe("w1", 1, 128, 128)
    assert accuracy.is_suspect("w1", 1)
    for _ in range(JUDGED_WINDOW):  # a window of predictions that hold clears it
        accuracy.observe("w1", 1, 128, 128)
    assert not accuracy.is_suspect("w1", 1)


def test_a_worker_that_keeps_turning_suspect_loses_its_credit_for_a_while() -> None:
    clock = ManualClock()
    turned: list[str] = []
    accuracy = PredictionAccuracy(
        suspect_after_misses=2,
        tolerance_tokens=TOLERANCE,
        withdraw_after_suspicions=3,
        withdrawal_s=600,
        clock=clock,
        on_suspect=turned.append,
    )
    for incarnation in (1, 2, 3):  # a new incarnation clears suspicion, not the record
        accuracy.observe("w1", incarnation, 128, 128)  # one prediction holds
        for _ in range(2):
            accuracy.observe("w1", incarnation, 128, 0)
        assert accuracy.is_suspect("w1", incarnation)
        accuracy.forget("w1")
        clock.advance(60)
    assert turned == ["w1", "w1", "w1"]
    assert accuracy.withdrawn() == {"w1"}
    accuracy.take_changed()
    # Predictions that hold, a new incarnation: the credit stays withdrawn.
    for _ in range(50):
        accuracy.observe("w1", 9, 128, 128)
    assert accuracy.is_suspect("w1", 9)
    assert accuracy.withdrawn_until("w1") == clock.now + 600 - 60
    assert "w1" in accuracy.suspects()
    assert not accuracy.is_suspect("w2", 1)  # other workers keep theirs
    clock.advance(600)
    assert accuracy.take_changed() == {"w1"}  # the WorkerPool re-reads its row
    assert not accuracy.is_suspect("w1", 9)
    assert accuracy.withdrawn() == set()
    # It starts over: one more suspicion is not a withdrawal.
    for _ in range(2):
        accuracy.observe("w1", 9, 128, 0)
    assert accuracy.is_suspect("w1", 9)
    accuracy.observe("w1", 9, 128, 128)
    assert not accuracy.is_suspect("w1", 9)


def test_suspicions_older_than_the_window_do_not_add_up() -> None:
    clock = ManualClock()
    accuracy = PredictionAccuracy(
        suspect_after_misses=2,
        tolerance_tokens=TOLERANCE,
        withdraw_after_suspicions=3,
        suspicion_window_s=3600,
        clock=clock,
    )
    for incarnation in range(1, 10):  # one suspicion every two hours, for eighteen hours
        for _ in range(2):
            accuracy.observe("w1", incarnation, 128, 0)
        accuracy.forget("w1")
        clock.advance(7200)
    assert accuracy.withdrawn() == set()


@pytest.mark.parametrize("stale_share", [0.1, 0.2, 0.3])
def test_an_honest_worker_that_is_sometimes_wrong_keeps_its_credit(stale_share: float) -> None:
    """An engine under memory pressure evicts blocks while requests queue: some of its
    worker's predictions fail, now and then five in a row. It turns suspect at times,
    and clears again; its credit is never withdrawn while most predictions hold."""
    rng = random.Random(7)
    clock = ManualClock()
    turned: list[str] = []
    accuracy = PredictionAccuracy(5, TOLERANCE, clock=clock, on_suspect=turned.append)
    for _ in range(20_000):  # a prediction every half second: close to three hours
        clock.advance(0.5)
        accuracy.observe("w1", 1, 128, 0 if rng.random() < stale_share else 128)
        assert accuracy.withdrawn() == set()
    if stale_share >= 0.3:
        assert len(turned) > 3  # it did turn suspect, more than the withdrawal's count
