"""The share arithmetic of tenants that compete: windows where a tenant is backlogged,
the service served inside them, and each tenant's figures in a cell."""

from __future__ import annotations

import math

import pytest

from benchmarks.live.client import Outcome
from benchmarks.live.fairness import (
    NOISY_GROUP,
    WELL_BEHAVED_GROUP,
    all_backlogged,
    backlogged,
    hit_rates,
    intersect,
    overlap,
    service_shares,
    service_within,
    tenant_figures,
    union,
)

START = 1000.0  # the cell's start, wall clock


def _answered(
    tenant: str,
    sent_s: float,
    ttft_s: float,
    latency_s: float,
    *,
    prompt: int = 100,
    cached: int = 0,
    output: int = 10,
) -> Outcome:
    return Outcome(
        ok=True,
        ttft_s=ttft_s,
        latency_s=latency_s,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        sent_at=START + sent_s,
        tenant=tenant,
    )


def _shed(tenant: str, sent_s: float, waited_s: float, reason: str) -> Outcome:
    return Outcome(
        ok=False, latency_s=waited_s, sent_at=START + sent_s, tenant=tenant, shed_reason=reason
    )


def test_intervals_merge_intersect_and_overlap() -> None:
    assert union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 6.0)]
    assert intersect([(0.0, 4.0), (5.0, 9.0)], [(3.0, 6.0), (8.0, 10.0)]) == [
        (3.0, 4.0),
        (5.0, 6.0),
        (8.0, 9.0),
    ]
    assert intersect([(0.0, 1.0)], [(1.0, 2.0)]) == []  # touching is not overlapping
    assert overlap((2.0, 7.0), [(0.0, 3.0), (5.0, 6.0)]) == pytest.approx(2.0)
    assert all_backlogged([[(0.0, 10.0)], [(2.0, 4.0), (6.0, 12.0)], [(3.0, 8.0)]]) == [
        (3.0, 4.0),
        (6.0, 8.0),
    ]
    assert all_backlogged([]) == []


def test_a_tenant_is_backlogged_from_two_seconds_into_a_wait_to_its_end() -> None:
    windows = backlogged(
        [
            _answered("a", 0.0, 0.5, 1.0),  # served at once: never backlogged
            _answered("a", 1.0, 5.0, 6.0),  # waited 5 s: backlogged 3.0-6.0
            _shed("a", 4.0, 4.0, "queue_timeout"),  # waited 4 s for its 429: 6.0-8.0
            _answered("b", 10.0, 2.5, 3.0),  # 12.0-12.5
            Outcome(ok=False, sent_at=START, tenant="b"),  # no wait known: left out
        ],
        START,
        wait_s=2.0,
    )
    assert windows == {"a": [(3.0, 8.0)], "b": [(12.0, 12.5)]}


def test_service_is_computed_prompt_at_the_first_token_and_the_answer_spread_to_the_end() -> None:
    # First token at 2 s, end at 6 s: 80 computed prompt tokens (cost 1 each) at 2 s,
    # 10 output tokens (cost 2 each, and 0.01 a token of the context each holds: the
    # 100-token prompt and the answer before it) spread evenly over 2-6 s.
    request = _answered("a", 0.0, 2.0, 6.0, prompt=100, cached=20, output=10)
    answer = 10 * 2 + sum(100 + n for n in range(10)) * 0.01
    assert service_within(request, START, [(0.0, 10.0)]) == pytest.approx(80 + answer)
    assert service_within(request, START, [(3.0, 5.0)]) == pytest.approx(answer / 2)
    assert service_within(request, START, [(1.0, 2.5)]) == pytest.approx(80 + answer / 8)
    assert service_within(_shed("a", 0.0, 3.0, "displaced"), START, [(0.0, 10.0)]) == 0.0


def test_shares_are_each_tenants_service_over_everyones_in_the_windows() -> None:
    outcomes = [
        _answered("a", 0.0, 1.0, 1.0, prompt=200, output=0),
        _answered("a", 0.0, 2.0, 2.0, prompt=200, output=0),
        _answered("b", 0.0, 1.5, 1.5, prompt=200, output=0),
        _answered("c", 0.0, 9.0, 9.0, prompt=200, output=0),  # outside the window
    ]
    shares = service_shares(outcomes, START, [(0.0, 5.0)])
    assert shares == pytest.approx({"a": 2 / 3, "b": 1 / 3, "c": 0.0})


def test_a_cells_tenant_figures() -> None:
    outcomes = [
        *(_answered("tenant-1", float(n), 0.2 + n / 100, 0.5) for n in range(10)),
        _answered("noisy", 0.0, 3.0, 3.5, output=20),  # waited 3 s: not backlogged
        _answered("noisy", 1.0, 6.0, 6.5, output=20),  # backlogged 4.0-7.0
        _shed("noisy", 2.0, 10.0, "queue_timeout"),  # backlogged 5.0-12.0
        _shed("noisy", 3.0, 0.01, "queue_full"),
        _answered("tenant-2", 30.0, 0.2, 25.0),  # ends after the schedule
        Outcome(ok=False, error="not sent or not finished", tenant="noisy"),
    ]
    figures = tenant_figures(
        outcomes,
        started_at=START,
        span_s=20.0,
        tenants=("tenant-1", "tenant-2", "noisy"),
        noisy="noisy",
        shares={},
    )
    assert list(figures.ttft_ms_by_group) == [WELL_BEHAVED_GROUP, NOISY_GROUP]
    assert figures.ttft_ms_by_group[WELL_BEHAVED_GROUP]["p50"] == pytest.approx(240.0)
    # The request never answered counts as an infinite TTFT, the sheds as none.
    assert figures.ttft_ms_by_group[NOISY_GROUP]["p50"] == pytest.approx(6000.0)
    assert figures.ttft_ms_by_group[NOISY_GROUP]["p99"] == math.inf
    assert figures.failed_by_group == {NOISY_GROUP: 1}
    assert figures.shed_by_tenant == {"noisy": {"queue_timeout": 1, "queue_full": 1}}
    assert figures.shed == 2
    assert figures.hit_rate_by_group == {WELL_BEHAVED_GROUP: 0.0, NOISY_GROUP: 0.0}
    assert figures.span_requests_per_s == pytest.approx(12 / 20)  # answered by 20 s
    assert figures.span_output_tokens_per_s == pytest.approx((10 * 10 + 2 * 20) / 20)
    assert figures.backlogged_s == pytest.approx({"tenant-1": 0.0, "tenant-2": 0.0, "noisy": 8.0})
    assert "tenant-1" not in figures.backlogged_share  # never backlogged
    # While the noisy tenant waited (4-12 s), tenant-1's requests sent at 4-9 s were
    # served (100 prompt tokens; 10 answer tokens at 2 each and 0.01 a token of the
    # context each holds), and the noisy tenant's second (20 answer tokens), its first
    # token at 7 s.
    tenant_1_each = 100 + 10 * 2 + sum(100 + n for n in range(10)) * 0.01
    noisy_then = 100 + 20 * 2 + sum(100 + n for n in range(20)) * 0.01
    share = noisy_then / (noisy_then + 6 * tenant_1_each)
    assert figures.backlogged_share["noisy"] == pytest.approx(share)
    assert figures.all_backlogged_s == 0.0  # the others never were
    assert figures.all_backlogged_shares == {}
    assert figures.configured_shares == pytest.approx(
        {"tenant-1": 1 / 3, "tenant-2": 1 / 3, "noisy": 1 / 3}
    )


def test_each_groups_hit_rate_is_over_its_answered_prompts() -> None:
    outcomes = [
        _answered("tenant-1", 0.0, 0.2, 0.5, prompt=1000, cached=900),
        _answered("tenant-2", 0.0, 0.2, 0.5, prompt=1000, cached=700),
        _answered("noisy", 0.0, 0.2, 0.5, prompt=4000, cached=1000),
        _shed("noisy", 1.0, 2.0, "queue_timeout"),  # no prompt served: left out
        Outcome(ok=False, error="not sent or not finished", tenant="tenant-1"),
    ]
    assert hit_rates(outcomes, "noisy") == pytest.approx(
        {WELL_BEHAVED_GROUP: 0.8, NOISY_GROUP: 0.25}
    )
    assert hit_rates(outcomes, None) == pytest.approx(
        {"tenant-1": 0.9, "tenant-2": 0.7, "noisy": 0.25}
    )


def test_shares_while_every_tenant_is_backlogged_against_the_configured_ones() -> None:
    # Two tenants both waiting over 3 s from 0 to 10 s; a served 2:1 by service.
    outcomes = [
        _answered("a", 0.0, 10.0, 10.0, output=0),  # backlogged 3-10
        _answered("b", 0.0, 10.0, 10.0, output=0),  # backlogged 3-10
        *(_answered("a", 2.0 + n, 1.0, 1.0, prompt=100, output=0) for n in range(6)),
        *(_answered("b", 2.0 + n, 1.0, 1.0, prompt=100, output=0) for n in range(3)),
    ]
    figures = tenant_figures(
        outcomes,
        started_at=START,
        span_s=10.0,
        tenants=("a", "b"),
        noisy=None,
        shares={"a": 2.0},
    )
    assert figures.all_backlogged_s == pytest.approx(7.0)
    assert figures.all_backlogged_shares == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert figures.configured_shares == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert figures.share_errors == pytest.approx({"a": 0.0, "b": 0.0})
    assert set(figures.ttft_ms_by_group) == {"a", "b"}  # no noisy tenant: each its own
