"""Admission on a Connect stream (router/control_plane/admission.py): the bearer token
and the order of batches."""

from __future__ import annotations

import pytest

from kvplane.wire.codec import Rejection
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.control_plane.admission import SequenceVerdict, authenticate, classify_sequence


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
    result = authenticate(metadata, "s3cret")
    if ok:
        assert result is None
    else:
        assert isinstance(result, Rejection)
        assert result.code == pb.REJECT_CODE_UNAUTHENTICATED
        assert result.label == "unauthenticated"


def test_no_token_configured_lets_every_call_in() -> None:
    assert authenticate(None, None) is None


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
