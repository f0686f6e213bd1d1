"""The pure decisions and bookkeeping of router/control_plane/workers.py."""

from __future__ import annotations

import pytest

from kvplane.core.types import LoadReport
from router.control_plane.workers import (
    DEAD_RETENTION_LEASES,
    RegisterVerdict,
    WorkerRecord,
    WorkerView,
    classify_register,
    needs_renewal,
)
from router.index.base import WorkerState
from tests.router.conftest import worker

LEASE_S = 2.0


def _view_with(incarnation: int = 5, now: float = 100.0) -> tuple[WorkerView, WorkerRecord]:
    view = WorkerView()
    record = view.registered(
        worker("w1", incarnation), stream=1, now=now, lease_s=LEASE_S, applied=0
    )
    return view, record


@pytest.mark.parametrize(
    ("incarnation", "verdict"),
    [(6, RegisterVerdict.NEW), (4, RegisterVerdict.STALE), (5, RegisterVerdict.RECONNECT)],
)
def test_register_verdict(incarnation: int, verdict: RegisterVerdict) -> None:
    _, record = _view_with()
    assert classify_register(record, incarnation) is verdict


def test_a_dead_incarnation_registering_again_is_the_indexs_to_judge() -> None:
    # This view's lease may be stale (the worker renewed through another router): the
    # index's register says what it still holds, and the record lives again from there.
    assert classify_register(None, 1) is RegisterVerdict.NEW
    view, record = _view_with()
    view.dead("w1", 102.5)
    assert classify_register(record, 5) is RegisterVerdict.RECONNECT
    assert classify_register(record, 4) is RegisterVerdict.STALE
    record = view.registered(worker("w1", 5), stream=2, now=103.0, lease_s=LEASE_S, applied=0)
    assert (record.state, record.dead_since, record.applied) == (WorkerState.LIVE, None, 0)


def test_renewal_is_due_after_a_quarter_lease() -> None:
    _, record = _view_with(now=100.0)
    assert not needs_renewal(record, 100.4, LEASE_S)
    assert needs_renewal(record, 100.5, LEASE_S)


def test_a_registration_takes_the_sequence_the_index_recorded() -> None:
    view, _ = _view_with()
    view.applied("w1", 5, 7, events_at=100.1)
    # A reconnect: the index is the judge (it may have lost batches 6 and 7).
    record = view.registered(worker("w1", 5), stream=2, now=100.2, lease_s=LEASE_S, applied=5)
    assert (record.applied, record.stream) == (5, 2)
    record = view.registered(worker("w1", 6), stream=3, now=100.3, lease_s=LEASE_S, applied=0)
    assert (record.applied, record.incarnation, record.stream) == (0, 6, 3)


def test_updates_for_another_incarnation_are_ignored() -> None:
    view, _ = _view_with(incarnation=5)
    view.applied("w1", 4, 9, events_at=100.1)
    view.load("w1", 4, LoadReport(1, 2, 0.5, 0), now=100.1)
    view.renewed("w1", 4, now=100.1, lease_s=LEASE_S, draining=True)
    record = view.get("w1")
    assert record is not None
    assert (record.applied, record.last_load, record.state) == (0, None, WorkerState.LIVE)


def test_draining_is_kept_by_later_renewals() -> None:
    view, _ = _view_with()
    view.renewed("w1", 5, now=100.1, lease_s=LEASE_S, draining=True)
    view.renewed("w1", 5, now=100.2, lease_s=LEASE_S, draining=False)
    assert view.counts_by_state() == {
        WorkerState.LIVE: 0,
        WorkerState.DRAINING: 1,
        WorkerState.DEAD: 0,
    }


def test_only_the_owning_stream_disconnects_the_worker() -> None:
    view, _ = _view_with()
    view.disconnected("w1", stream=99)
    assert view.records()[0].stream == 1
    view.disconnected("w1", stream=1)
    assert view.records()[0].stream is None


def test_sweep_marks_purged_and_expired_dead_then_forgets_them() -> None:
    view = WorkerView()
    view.registered(worker("purged"), stream=1, now=100.0, lease_s=LEASE_S, applied=0)
    view.registered(worker("expired"), stream=2, now=100.0, lease_s=LEASE_S, applied=0)
    view.registered(worker("alive"), stream=3, now=101.0, lease_s=LEASE_S, applied=0)

    view.sweep(["purged"], now=102.5, lease_s=LEASE_S)

    states = {r.info.worker_id: r.state for r in view.records()}
    assert states == {
        "purged": WorkerState.DEAD,
        "expired": WorkerState.DEAD,
        "alive": WorkerState.LIVE,
    }
    view.renewed("alive", 1, now=102.5, lease_s=1000.0, draining=False)
    view.sweep([], now=102.5 + DEAD_RETENTION_LEASES * LEASE_S + 0.1, lease_s=LEASE_S)
    assert [r.info.worker_id for r in view.records()] == ["alive"]


def test_a_renewal_revives_a_worker_guessed_dead() -> None:
    view, _ = _view_with()
    view.sweep([], now=103.0, lease_s=LEASE_S)
    view.renewed("w1", 5, now=103.0, lease_s=LEASE_S, draining=False)
    record = view.get("w1")
    assert record is not None
    assert (record.state, record.dead_since) == (WorkerState.LIVE, None)
