"""Admission on a Connect stream (router/control_plane/admission.py): the bearer token
and the order of batches."""

from __future__ import annotations

import pytest

from kvplane.core.worker_credentials import worker_token
from kvplane.wire.codec import Rejection
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.control_plane.admission import (
    SequenceVerdict,
    authenticate,
    authenticate_worker,
    classify_sequence,
    presented_token,
)

SECRET = "a-router-secret-of-at-least-32-characters"


@pytest.mark.parametrize(
    ("metadata", "ok"),
    [
        ((("authorization", "Bearer s3cret"),), True),
        ((("authorization", "bearer s3cret"),), True),
        ((("user-agent", "x"), ("authorization", b"Bearer s3cret")), True),
        ((("authorization", "Bearer wrong"),), False),
        ((("authorization", "Bearer s3cret-and-more"),), False),
        ((("authorization", "Basic s3cret"),), False),
        ((("authorization", "Bearer "),), False),
        ((), False),
        (None, False),
    ],
)
def test_bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None, ok: bool) -> None:
    result = authenticate(presented_token(metadata), "s3cret")
    if ok:
        assert result is None
    else:
        assert isinstance(result, Rejection)
        assert result.code == pb.REJECT_CODE_UNAUTHENTICATED
        assert result.label == "unauthenticated"


def test_no_token_configured_lets_every_call_in() -> None:
    assert authenticate(presented_token(None), None) is None


def test_a_worker_token_speaks_for_its_worker_only() -> None:
    mine = worker_token(SECRET, "w1").encode()
    assert authenticate_worker(mine, SECRET, "w1") is None
    for presented, worker_id in [
        (mine, "w2"),  # another worker's token
        (worker_token("another-secret-of-at-least-32-characters", "w1").encode(), "w1"),
        (mine[:-1], "w1"),
        (b"", "w1"),
    ]:
        refused = authenticate_worker(presented, SECRET, worker_id)
        assert isinstance(refused, Rejection)
        assert refused.code == pb.REJECT_CODE_UNAUTHENTICATED
        assert worker_id in refused.reason
    assert authenticate_worker(b"", None, "w1") is None  # no credentials configured


def test_worker_tokens_are_stable_and_distinct() -> None:
    assert worker_token(SECRET, "w1") == worker_token(SECRET, "w1")
    assert worker_token(SECRET, "w1") != worker_token(SECRET, "w2")
    assert worker_token(SECRET, "w1").startswith("kvw1.")


@pytest.mark.parametrize(
    ("sequence", "last", "verdict"),
    [
        (1, 0, SequenceVerdict.NEXT),
        (6, 5, SequenceVerdict.NEXT),
        (5, 5, SequenceVerdict.DUPLICATE),
        (1, 5, SequenceVerdict.DUPLICATE),
        (7, 5, SequenceVerdict.GAP),
        (2, 0, SequenceVerdict.GAP),
    ],
)
def test_sequence_verdict(sequence: int, last: int, verdict: SequenceVerdict) -> None:
    assert classify_sequence(sequence, last) is verdict
