"""Admission on a Connect stream (router/control_plane/admission.py): the bearer token
and the order of batches."""

from __future__ import annotations

import ipaddress

import pytest

from kvplane.core.worker_credentials import worker_token
from kvplane.wire.codec import Rejection
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.control_plane.admission import (
    SequenceVerdict,
    authenticate,
    authenticate_worker,
    classify_sequence,
    engine_host_allowed,
    peer_address,
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


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:10.0.0.5:4321", "10.0.0.5"),
        ("ipv6:[::1]:4321", "::1"),
        ("ipv6:[fe80::1%eth0]:4321", "fe80::1"),
        ("unix:/tmp/socket", None),
        ("ipv4:not-an-address:1", None),
        ("", None),
        (None, None),
    ],
)
def test_the_agents_address_is_read_off_the_grpc_peer(
    peer: str | None, address: str | None
) -> None:
    found = peer_address(peer)
    assert (None if found is None else str(found)) == address


@pytest.mark.parametrize(
    ("host", "agent", "allowed", "ok"),
    [
        ("10.0.0.5", "10.0.0.5", [], True),  # the agent's own address: a sidecar
        ("10.0.0.6", "10.0.0.5", [], False),  # anywhere else
        ("10.0.0.6", "10.0.0.5", ["10.0.0.0/24"], True),
        ("10.0.1.6", "10.0.0.5", ["10.0.0.0/24"], False),
        ("localhost", "127.0.0.1", [], True),
        ("localhost", "10.0.0.5", [], False),
        ("engine.ns.svc", "10.0.0.5", [], False),  # names are never resolved
        ("engine.ns.svc", "10.0.0.5", ["engine.ns.svc"], True),
        ("::1", "::1", [], True),
        ("10.0.0.5", None, [], False),  # an agent on a Unix socket: only what is listed
    ],
)
def test_an_engine_may_be_where_its_agent_is_or_where_listed(
    host: str, agent: str | None, allowed: list[str], ok: bool
) -> None:
    address = None if agent is None else ipaddress.ip_address(agent)
    assert engine_host_allowed(host, address, allowed) is ok
