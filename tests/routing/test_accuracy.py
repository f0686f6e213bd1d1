"""Prediction accuracy: engines' cached-token reports judged against the router's belief."""

from __future__ import annotations

import pytest

from router.routing.accuracy import PredictionAccuracy, Verdict, judge

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
