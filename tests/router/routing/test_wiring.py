"""The router's judgement of each worker's wiring (pure), its token-count comparison,
and the vouching of an engine's hits by index entries."""

from __future__ import annotations

import pytest

from kvplane.core.types import EventsState, ReplayState, WiringReport
from router.routing.accuracy import UNVOUCHED_AFTER_HITS, PredictionAccuracy
from router.routing.token_agreement import MIN_SAMPLES, WARN_EVERY_S, TokenCountAgreement
from router.routing.wiring import (
    Check,
    CheckStatus,
    WorkerWiringFacts,
    is_blind,
    model_routing,
    with_probe,
    worker_checks,
)

FLOWING = WiringReport(EventsState.FLOWING, ReplayState.OK, engine_block_size=16)
W = ("w", 1)  # a worker incarnation
AGREEING = TokenCountAgreement()
for _ in range(MIN_SAMPLES):
    AGREEING.observe(W, 100, 100)


def facts(report: WiringReport | None = FLOWING, **fields: object) -> WorkerWiringFacts:
    values: dict[str, object] = {
        "report": report,
        "stream_here": True,
        "router_block_size": 32,
        "agreement": AGREEING.of(W),
        "recent_hits": 6,
        "vouched_hits": 5,
    }
    values.update(fields)
    return WorkerWiringFacts(**values)  # type: ignore[arg-type]


def statuses(checks: list[Check]) -> dict[str, CheckStatus]:
    return {check.name: check.status for check in checks}


def test_a_worker_wired_right_passes_every_check() -> None:
    checks = worker_checks(facts())
    assert set(statuses(checks).values()) == {CheckStatus.PASS}
    assert not is_blind(checks)


@pytest.mark.parametrize("state", [EventsState.NOT_CONNECTED, EventsState.SILENT])
def test_events_that_do_not_reach_the_agent_blind_the_router(state: EventsState) -> None:
    report = WiringReport(state, ReplayState.OK, 16, events_detail="set tcp://*:5557")
    checks = worker_checks(facts(report))
    events = next(c for c in checks if c.name == "events")
    assert events.status is CheckStatus.FAIL
    assert state.value in events.detail
    assert "tcp://*:5557" in events.detail  # the agent's fix, passed on
    assert is_blind(checks)


def test_a_state_newer_than_the_router_is_unknown_with_the_agents_words() -> None:
    newer = WiringReport(EventsState.UNKNOWN, ReplayState.UNKNOWN, 16, "judged anew", "fine")
    found = {c.name: c for c in worker_checks(facts(newer))}
    assert found["events"].status is CheckStatus.UNKNOWN
    assert found["events"].detail == "judged anew"
    assert found["replay"].detail == "fine"


def test_unproven_events_and_replays_are_unknown_and_a_missing_replay_a_warning() -> None:
    quiet = WiringReport(EventsState.NEVER_SEEN, ReplayState.NOT_CONFIGURED, None)
    found = statuses(worker_checks(facts(quiet)))
    assert found["events"] is CheckStatus.UNKNOWN
    assert found["replay"] is CheckStatus.WARN
    assert found["block_size"] is CheckStatus.UNKNOWN
    assert not is_blind(worker_checks(facts(quiet)))


def test_a_failing_replay_fails_its_check_without_blinding() -> None:
    report = WiringReport(EventsState.FLOWING, ReplayState.FAILING, 16, replay_detail="no answer")
    checks = worker_checks(facts(report))
    assert statuses(checks)["replay"] is CheckStatus.FAIL
    assert not is_blind(checks)


def test_a_worker_reporting_to_another_replica_or_an_old_agent_is_unknown() -> None:
    elsewhere = worker_checks(facts(None, stream_here=False))
    old_agent = worker_checks(facts(None, stream_here=True))
    for checks in (elsewhere, old_agent):
        found = statuses(checks)
        assert found["events"] is found["replay"] is found["block_size"] is CheckStatus.UNKNOWN
    assert "another router replica" in elsewhere[0].detail
    assert "does not report" in old_agent[0].detail


def test_an_engine_block_size_that_does_not_divide_the_routers_fails() -> None:
    report = WiringReport(EventsState.FLOWING, ReplayState.OK, engine_block_size=24)
    checks = worker_checks(facts(report))
    block = next(c for c in checks if c.name == "block_size")
    assert block.status is CheckStatus.FAIL
    assert "24" in block.detail
    assert "multiple of 24" in block.fix
    assert is_blind(checks)


def test_token_counts_that_differ_fail_the_tokenizer_check() -> None:
    agreement = TokenCountAgreement()
    for _ in range(MIN_SAMPLES - 1):
        agreement.observe(W, 100, 90)
    assert statuses(worker_checks(facts(agreement=agreement.of(W))))["tokenizer"] is (
        CheckStatus.UNKNOWN
    )
    agreement.observe(W, 100, 90)
    checks = worker_checks(facts(agreement=agreement.of(W)))
    tokenizer = next(c for c in checks if c.name == "tokenizer")
    assert tokenizer.status is CheckStatus.FAIL
    assert "the router counted 100, the engine 90" in tokenizer.detail
    assert is_blind(checks)


def test_a_rare_difference_in_counts_is_tolerated() -> None:
    agreement = TokenCountAgreement()
    agreement.observe(W, 100, 99)  # an engine's own reason: a prompt it cut, say
    for _ in range(7):
        agreement.observe(W, 100, 100)
    assert agreement.of(W).agrees
    assert statuses(worker_checks(facts(agreement=agreement.of(W))))["tokenizer"] is (
        CheckStatus.PASS
    )


def test_a_workers_next_incarnation_starts_afresh_and_gone_ones_are_forgotten() -> None:
    agreement = TokenCountAgreement()
    for _ in range(MIN_SAMPLES):
        agreement.observe(W, 100, 90)
        agreement.observe(("other", 3), 10, 10)
    assert agreement.of(W).disagrees
    assert agreement.of(("w", 2)).samples == 0  # restarted beside another engine, maybe
    agreement.retain([("w", 2), ("other", 3)])
    assert agreement.of(W).samples == 0
    assert agreement.of(("other", 3)).agrees


def test_a_disagreement_is_warned_about_once_a_minute() -> None:
    agreement = TokenCountAgreement()
    for _ in range(MIN_SAMPLES):
        agreement.observe(W, 10, 12)
    assert agreement.warning_due(W, now=100.0)
    assert not agreement.warning_due(W, now=100.0 + WARN_EVERY_S - 1)
    assert agreement.warning_due(W, now=100.0 + WARN_EVERY_S)
    assert not agreement.warning_due(("other", 1), now=500.0)


def test_hits_foreseen_only_by_the_routers_own_predictions_are_flagged() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=3, tolerance_tokens=16)
    for _ in range(UNVOUCHED_AFTER_HITS):
        accuracy.observe("w", 1, 0, 64, self_predicted_tokens=64)
    assert accuracy.vouching("w", 1) == (UNVOUCHED_AFTER_HITS, 0)
    not_yet = worker_checks(facts(recent_hits=UNVOUCHED_AFTER_HITS - 1, vouched_hits=0))
    assert statuses(not_yet)["index_vouches"] is CheckStatus.UNKNOWN
    vouching = next(
        c
        for c in worker_checks(facts(recent_hits=UNVOUCHED_AFTER_HITS, vouched_hits=0))
        if c.name == "index_vouches"
    )
    assert vouching.status is CheckStatus.FAIL
    # One hit the index entries foresaw clears it; a new incarnation starts afresh.
    accuracy.observe("w", 1, 32, 64, self_predicted_tokens=32)
    assert accuracy.vouching("w", 1) == (UNVOUCHED_AFTER_HITS + 1, 1)
    assert accuracy.vouching("w", 2) == (0, 0)


def test_requests_the_engine_found_nothing_for_are_no_hits() -> None:
    accuracy = PredictionAccuracy(suspect_after_misses=3, tolerance_tokens=16)
    for _ in range(10):
        accuracy.observe("w", 1, 0, 0, self_predicted_tokens=64)  # predicted, not found
        accuracy.observe("w", 1, 0, 64)  # found, not predicted
    assert accuracy.vouching("w", 1) == (0, 0)


def test_a_model_is_routed_on_predictions_only_when_every_worker_is_blind() -> None:
    assert model_routing([("a", True), ("a", False), ("b", True), ("b", True)]) == {
        "a": "cache_aware",
        "b": "predictions_only",
    }
    assert model_routing([]) == {}


def test_a_probe_that_reached_the_index_proves_the_events_of_an_idle_engine() -> None:
    idle = worker_checks(facts(WiringReport(EventsState.NEVER_SEEN, ReplayState.OK, 16)))
    reached = Check("probe_index", CheckStatus.PASS, "7 of 7 blocks")
    merged = {c.name: c.status for c in with_probe(idle, [reached])}
    assert merged["events"] is CheckStatus.PASS
    assert merged["probe_index"] is CheckStatus.PASS
    missed = Check("probe_index", CheckStatus.FAIL, "none")
    assert {c.name: c.status for c in with_probe(idle, [missed])}["events"] is (CheckStatus.UNKNOWN)
    # A failure the agent reported stands, whatever the probe says.
    lonely = worker_checks(facts(WiringReport(EventsState.NOT_CONNECTED, ReplayState.OK, 16)))
    assert {c.name: c.status for c in with_probe(lonely, [reached])}["events"] is (CheckStatus.FAIL)
