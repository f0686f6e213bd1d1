"""A request's band and deadline, from its tenant and its headers."""

from __future__ import annotations

import dataclasses

import pytest

from kvplane.core.config import FlowControlSettings
from router.errors import RequestRefused
from router.flow_control.bands import Placement, engine_priority, placement
from router.tenants import ANONYMOUS_TENANT

BATCH = dataclasses.replace(ANONYMOUS_TENANT, name="batch", priority=-1)
CHAT = dataclasses.replace(ANONYMOUS_TENANT, name="chat", priority=1, max_priority=5)


def test_the_band_is_the_tenants_unless_it_may_ask_for_another() -> None:
    assert placement(BATCH, None, None) == Placement(-1)
    assert placement(BATCH, "9", None) == Placement(-1)  # it may not: ignored
    assert placement(CHAT, None, None) == Placement(1)
    assert placement(CHAT, " 3 ", None) == Placement(3)
    assert placement(CHAT, "9", None) == Placement(5)  # capped at its maximum
    assert placement(CHAT, "-7", None) == Placement(-7)  # lower is always allowed


def test_a_deadline_is_in_seconds_from_milliseconds() -> None:
    assert placement(BATCH, None, "250") == Placement(-1, 0.25)


@pytest.mark.parametrize(
    ("priority", "deadline"),
    [("high", None), ("1.5", None), ("1001", None), (None, "0"), (None, "soon"), (None, "-5")],
)
def test_a_header_out_of_its_range_is_a_400(priority: str | None, deadline: str | None) -> None:
    with pytest.raises(RequestRefused) as refused:
        placement(CHAT, priority, deadline)
    assert (refused.value.status, refused.value.outcome) == (400, "bad_header")
    assert "must be a whole number" in str(refused.value)


def test_engine_priorities_keep_bands_apart_and_a_backlog_behind_its_band() -> None:
    ordered = [
        engine_priority(5, backlogged=False),
        engine_priority(5, backlogged=True),
        engine_priority(0, backlogged=False),
        engine_priority(0, backlogged=True),
        engine_priority(-1, backlogged=False),
    ]
    assert ordered == sorted(ordered)  # vLLM runs the lowest first
    assert len(set(ordered)) == len(ordered)
    assert engine_priority(0, backlogged=False) == 0  # nothing sent


def test_a_backlog_never_takes_more_engine_places_than_anyone() -> None:
    assert FlowControlSettings(max_engine_waiting=0).backlogged_engine_waiting == 0
    assert FlowControlSettings(max_engine_waiting=3).backlogged_engine_waiting == 1
    settings = FlowControlSettings(max_engine_waiting=2, max_engine_waiting_backlogged=5)
    assert settings.backlogged_engine_waiting == 2
