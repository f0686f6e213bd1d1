"""Which tenant asked for more than its share lately (router/flow_control/counters.py's
RecentDemand): pure, on an explicit clock."""

from __future__ import annotations

from router.flow_control.counters import RecentDemand

MODEL = "m"


def asked(**amounts: float) -> RecentDemand:
    recent = RecentDemand(window_s=10.0)
    for tenant, amount in amounts.items():
        recent.asked(MODEL, tenant, amount, now=0.0)
    return recent


def test_a_flood_is_over_its_share_and_the_tenants_beside_it_are_not() -> None:
    recent = asked(noisy=35.0, a=16.0, b=16.0, c=17.0, d=16.0)
    assert recent.over_share(MODEL, 0.0, waiting=["noisy", "a"]) == {"noisy"}


def test_tenants_with_equal_demands_stay_under_it_through_their_noise() -> None:
    recent = asked(a=22.0, b=18.0, c=20.0, d=20.0)
    assert recent.over_share(MODEL, 0.0, waiting="abcd") == set()


def test_a_tenant_alone_has_all_of_its_share() -> None:
    assert asked(noisy=100.0).over_share(MODEL, 0.0, waiting=["noisy"]) == set()


def test_a_tenant_that_starts_waiting_counts_among_those_sharing() -> None:
    recent = asked(noisy=100.0)
    assert recent.over_share(MODEL, 0.0, waiting=["noisy", "acme"]) == {"noisy"}


def test_demand_is_forgotten_over_the_window() -> None:
    recent = asked(a=100.0)
    recent.asked(MODEL, "b", 20.0, now=30.0)  # a's 100 has decayed to 5 by then
    assert recent.over_share(MODEL, 30.0, waiting=[]) == {"b"}
    # Long after, a's is all but nothing beside b's latest: b asks alone.
    recent.asked(MODEL, "b", 20.0, now=80.0)
    assert recent.over_share(MODEL, 80.0, waiting=[]) == set()


def test_models_are_apart() -> None:
    recent = asked(noisy=100.0, a=5.0)
    recent.asked("other", "a", 100.0, now=0.0)
    assert recent.over_share(MODEL, 0.0, waiting=[]) == {"noisy"}
    assert recent.over_share("other", 0.0, waiting=[]) == set()


def test_tenants_all_asking_past_their_shares_are_not_over_them() -> None:
    # Three tenants each asking 0.8 of the fleet, shares 2:1:1 (demand divided by share).
    recent = asked(a=0.8 / 2, b=0.8, c=0.8)
    assert recent.over_share(MODEL, 0.0, waiting="abc") == set()
