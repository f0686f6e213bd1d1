"""The wire codec (kvplane/wire/codec.py): encoding for agents, decoding and the pure
checks for the control plane, message by message."""

from __future__ import annotations

import math
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.core.keys import SCHEME_VERSION
from kvplane.core.types import (
    MAX_CHAIN_END,
    MAX_SKIPPED_KINDS,
    MAX_WIRING_DETAIL_CHARS,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventsState,
    KvEvent,
    ReplayState,
    SkippedEvents,
    SkipReason,
    Tier,
    WiringReport,
)
from kvplane.wire.codec import (
    UNREADABLE_DETAIL,
    Limits,
    Rejection,
    event_to_wire,
    events_message,
    load_message,
    parse_kv_events,
    parse_load,
    parse_register,
    register_message,
)
from kvplane.wire.v1 import control_plane_pb2 as pb
from tests.router.conftest import BLOCK_SIZE, worker

LIMITS = Limits(
    block_size=BLOCK_SIZE,
    key_scheme_version=SCHEME_VERSION,
    max_batch_events=8,
    max_batch_blocks=32,
)


def _register(**fields: object) -> pb.Register:
    message = register_message(worker()).register
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def test_register_becomes_worker_info() -> None:
    info = worker("pod-7.zone_a:0", 42, kv_capacity_blocks=900, labels={"zone": "a"})
    assert parse_register(register_message(info).register, LIMITS) == info


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"worker_id": ""}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"worker_id": "x" * 129}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"worker_id": "a/b"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"incarnation": 0}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"base_url": "ftp://host/"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"base_url": "http://"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"base_url": "host:8000"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"base_url": "http://host:99999"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"base_url": "http://[::1"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"model": ""}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"engine_version": "0.5." + "1" * 64}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"engine_version": "0.5.17\n"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"engine_kind": "\x1b[31mvllm"}, pb.REJECT_CODE_INVALID_MESSAGE),
        ({"block_size": BLOCK_SIZE * 2}, pb.REJECT_CODE_INCOMPATIBLE),
        ({"key_scheme_version": SCHEME_VERSION + 1}, pb.REJECT_CODE_INCOMPATIBLE),
    ],
)
def test_bad_register(fields: dict[str, object], code: int) -> None:
    result = parse_register(_register(**fields), LIMITS)
    assert isinstance(result, Rejection)
    assert result.code == code


def test_longest_worker_id_and_https_are_accepted() -> None:
    message = _register(worker_id="w" * 128, base_url="https://[::1]:8443/v1")
    assert not isinstance(parse_register(message, LIMITS), Rejection)


def _stored(keys: list[int], **fields: object) -> pb.KvEvent:
    event = event_to_wire(BlocksStored(keys=keys, tier=Tier.DEVICE))
    for name, value in fields.items():
        setattr(event.stored, name, value)
    return event


def _batch(*events: pb.KvEvent, sequence: int = 1) -> pb.KvEvents:
    return pb.KvEvents(sequence=sequence, events=events)


def test_batch_becomes_events_in_order() -> None:
    events: list[KvEvent] = [
        BlocksStored(keys=[1, 2], tier=Tier.HOST),
        BlocksStored(keys=[3], tier=Tier.DISK, first_position=2, parent_key=2),
        BlocksRemoved(keys=[1], tier=Tier.HOST),
        AllBlocksCleared(),
        BlocksStored(keys=[9], tier=Tier.REMOTE, first_position=5, parent_key=0),
    ]
    assert parse_kv_events(events_message(3, events).kv_events, LIMITS) == events


@pytest.mark.parametrize(
    ("batch", "code", "reason"),
    [
        (_batch(sequence=0), pb.REJECT_CODE_INVALID_MESSAGE, "sequence"),
        (_batch(*[_stored([1])] * 9), pb.REJECT_CODE_BATCH_TOO_LARGE, "9 events"),
        (
            _batch(
                _stored(list(range(20))),
                pb.KvEvent(removed=pb.BlocksRemoved(keys=[1] * 13, tier=pb.TIER_HOST)),
            ),
            pb.REJECT_CODE_BATCH_TOO_LARGE,
            "33 blocks",
        ),
        (_batch(_stored([1], tier=pb.TIER_UNSPECIFIED)), pb.REJECT_CODE_INVALID_MESSAGE, "tier 0"),
        (_batch(_stored([1], tier=9)), pb.REJECT_CODE_INVALID_MESSAGE, "tier 9"),
        (
            _batch(pb.KvEvent(removed=pb.BlocksRemoved(keys=[1], tier=cast(pb.Tier, 7)))),
            pb.REJECT_CODE_INVALID_MESSAGE,
            "tier 7",
        ),
        (_batch(_stored([1], first_position=3)), pb.REJECT_CODE_INVALID_MESSAGE, "parent_key"),
        (_batch(_stored([1], parent_key=5)), pb.REJECT_CODE_INVALID_MESSAGE, "parent_key"),
        (_batch(_stored([])), pb.REJECT_CODE_INVALID_MESSAGE, "without keys"),
        (
            _batch(pb.KvEvent(removed=pb.BlocksRemoved(tier=pb.TIER_HOST))),
            pb.REJECT_CODE_INVALID_MESSAGE,
            "without keys",
        ),
        (_batch(_stored([1]), pb.KvEvent()), pb.REJECT_CODE_INVALID_MESSAGE, "event 1"),
        (
            _batch(_stored([1, 2], parent_key=1, first_position=MAX_CHAIN_END - 1)),
            pb.REJECT_CODE_INVALID_MESSAGE,
            "chain positions",
        ),
    ],
)
def test_bad_batch(batch: pb.KvEvents, code: int, reason: str) -> None:
    result = parse_kv_events(batch, LIMITS)
    assert isinstance(result, Rejection)
    assert result.code == code
    assert reason in result.reason


def test_batch_at_the_limits_is_accepted() -> None:
    batch = _batch(*[_stored([i, i + 100, i + 200, i + 300]) for i in range(8)])
    parsed = parse_kv_events(batch, LIMITS)
    assert not isinstance(parsed, Rejection)
    assert len(parsed) == 8
    last = _batch(_stored([1], parent_key=1, first_position=MAX_CHAIN_END - 1))
    assert not isinstance(parse_kv_events(last, LIMITS), Rejection)


_keys = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4)
_tiers = st.sampled_from(list(Tier))
_events = st.one_of(
    st.builds(BlocksStored, keys=_keys, tier=_tiers),
    st.builds(
        BlocksStored,
        keys=_keys,
        tier=_tiers,
        first_position=st.integers(1, 2**20),
        parent_key=st.integers(0, 2**64 - 1),
    ),
    st.builds(BlocksRemoved, keys=_keys, tier=_tiers),
    st.just(AllBlocksCleared()),
)


@given(sequence=st.integers(1, 2**64 - 1), events=st.lists(_events, max_size=8))
def test_every_valid_batch_survives_the_wire(sequence: int, events: list[KvEvent]) -> None:
    wire = pb.KvEvents.FromString(events_message(sequence, events).kv_events.SerializeToString())
    assert parse_kv_events(wire, LIMITS) == events


@pytest.mark.parametrize("usage", [math.nan, math.inf, -math.inf, -0.01, 1.01])
def test_bad_kv_usage(usage: float) -> None:
    result = parse_load(pb.Load(running=1, kv_usage=usage))
    assert isinstance(result, Rejection)
    assert result.code == pb.REJECT_CODE_INVALID_MESSAGE


@pytest.mark.parametrize("usage", [0.0, 0.5, 1.0])
def test_load_report(usage: float) -> None:
    report = parse_load(pb.Load(running=4, waiting=2, kv_usage=usage, timestamp_ms=17))
    assert not isinstance(report, Rejection)
    assert (report.running, report.waiting, report.kv_usage, report.timestamp_ms) == (
        4,
        2,
        usage,
        17,
    )
    assert report.wiring is None  # an agent older than the field sends none


@pytest.mark.parametrize("events", list(EventsState))
@pytest.mark.parametrize("replay", list(ReplayState))
def test_a_wiring_report_survives_the_wire(events: EventsState, replay: ReplayState) -> None:
    wiring = WiringReport(events, replay, 16, events_detail="bind tcp://*:5557", replay_detail="")
    report = parse_load(load_message(1, 0, 0.5, wiring=wiring).load)
    assert not isinstance(report, Rejection)
    assert report.wiring == wiring


def test_a_wiring_report_from_a_newer_contract_is_unknown_not_refused() -> None:
    report = parse_load(pb.Load(kv_usage=0.1, wiring=pb.Wiring(events=99, replay=42)))
    assert not isinstance(report, Rejection)
    assert report.wiring == WiringReport(EventsState.UNKNOWN, ReplayState.UNKNOWN, None)


@pytest.mark.parametrize(
    "wiring",
    [
        pb.Wiring(events_detail="x" * (MAX_WIRING_DETAIL_CHARS + 1)),
        pb.Wiring(replay_detail="two\nlines"),
        pb.Wiring(events_detail="a bell \a"),
    ],
)
def test_a_wiring_detail_that_is_no_single_short_line_is_replaced(wiring: pb.Wiring) -> None:
    # A diagnosis never costs the heartbeat it comes with.
    report = parse_load(pb.Load(kv_usage=0.1, wiring=wiring))
    assert not isinstance(report, Rejection)
    assert report.wiring is not None
    assert UNREADABLE_DETAIL in (report.wiring.events_detail, report.wiring.replay_detail)


def test_an_agents_detail_is_made_one_short_printable_line() -> None:
    wiring = WiringReport(
        EventsState.SILENT, ReplayState.OK, 16, events_detail="y" * 2000, replay_detail="a\nb"
    )
    report = parse_load(load_message(0, 0, 0.0, wiring=wiring).load)
    assert not isinstance(report, Rejection)
    assert report.wiring is not None
    assert report.wiring.events_detail == "y" * MAX_WIRING_DETAIL_CHARS
    assert report.wiring.replay_detail == "a b"


def test_skipped_event_counts_survive_the_wire_most_first_and_bounded() -> None:
    kinds = [
        SkippedEvents(f"Type{n}", SkipReason.UNKNOWN_TYPE, n) for n in range(MAX_SKIPPED_KINDS + 4)
    ]
    wiring = WiringReport(EventsState.FLOWING, ReplayState.OK, 16, skipped_events=tuple(kinds))
    report = parse_load(load_message(0, 0, 0.0, wiring=wiring).load)
    assert not isinstance(report, Rejection)
    assert report.wiring is not None
    assert report.wiring.skipped_events == tuple(reversed(kinds))[:MAX_SKIPPED_KINDS]


def test_skipped_event_counts_that_would_be_bad_labels_are_left_out() -> None:
    wiring = pb.Wiring(
        skipped_events=[
            pb.SkippedEvents(event_type="BlockStored", reason="remote", count=3),
            pb.SkippedEvents(event_type="BlockStored", reason="because", count=1),
            pb.SkippedEvents(event_type="x" * 65, reason="malformed", count=1),
            pb.SkippedEvents(event_type="two\nlines", reason="malformed", count=1),
            pb.SkippedEvents(event_type="", reason="malformed", count=1),
            *[
                pb.SkippedEvents(event_type=f"T{n}", reason="unknown_type", count=1)
                for n in range(MAX_SKIPPED_KINDS)
            ],
        ]
    )
    report = parse_load(pb.Load(kv_usage=0.1, wiring=wiring))  # the heartbeat itself stands
    assert not isinstance(report, Rejection)
    assert report.wiring is not None
    skipped = report.wiring.skipped_events
    assert skipped[0] == SkippedEvents("BlockStored", SkipReason.REMOTE, 3)
    assert len(skipped) == MAX_SKIPPED_KINDS
    assert all(s.event_type == "BlockStored" or s.event_type.startswith("T") for s in skipped)
