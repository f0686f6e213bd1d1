"""Checking the router's predictions against what engines report.

After a response, the engine's `usage.prompt_tokens_details.cached_tokens` (when it
sends one) says how much of the prompt it really found cached. A report that falls
short of the prediction by more than the tolerance (one engine block: engines count
in their own blocks, and recompute a fully cached prompt's last token) is a stale
location: the index believed in blocks the engine no longer had. A worker whose
predictions keep failing (`suspect_after_misses` in a row, or half of its last
JUDGED_WINDOW) has suspect index entries: scoring stops counting on them until its
predictions hold again or the worker starts a new incarnation.

A worker that turns suspect again and again (`withdraw_after_suspicions` times within
`suspicion_window_s`) while most of its recent predictions, across its incarnations,
failed, loses its cache credit for `withdrawal_s`, whatever it does meanwhile, new
incarnations included: an agent that announces blocks its engine does not hold
(another tenant's, to draw its traffic) gains a few requests, and then nothing, and the
metrics and the fleet API show it. An honest worker under memory pressure turns
suspect now and then; with most of its predictions holding, it keeps its credit.

Only the part of a prediction that the worker's own events vouched for (its index
entries) is judged: the rest came from this router's predicted entries, which are its
own guesses. A worker whose engine keeps reporting hits that only those guesses
foresaw is *unvouched* (router/routing/wiring.py judges it): its events are not reaching
the index (or carry other keys), and routing there is approximate, however well the
guesses do.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.core.clock import Clock


class Verdict(enum.Enum):
    CONFIRMED = "confirmed"  # the engine found what was predicted, within tolerance
    STALE = "stale"  # it found less: locations the index believed were gone
    BETTER = "better"  # it found more (events not arrived yet, or another scope's hit)


def judge(predicted_tokens: int, reported_tokens: int, tolerance_tokens: int) -> Verdict:
    if reported_tokens < predicted_tokens - tolerance_tokens:
        return Verdict.STALE
    if reported_tokens > predicted_tokens + tolerance_tokens:
        return Verdict.BETTER
    return Verdict.CONFIRMED


HITS_WINDOW = 32
"""The worker's recent hits (requests the engine found cached) looked at for vouching."""
UNVOUCHED_AFTER_HITS = 4
JUDGED_WINDOW = 32
"""A worker's last judged predictions (of something its entries vouched for): with at
least half of it filled, a worker half of whose predictions in it were stale is suspect
however it spaces its misses."""
STANDING_WINDOW = 128
"""A worker id's last judged predictions, across its incarnations, that decide whether
its repeated suspicions withdraw its credit: most of them stale."""


@dataclass(slots=True)
class _Record:
    """What one incarnation of a worker has shown."""

    incarnation: int
    misses_in_a_row: int = 0
    # Per recent hit: whether the worker's index entries vouched for any of it.
    hits_vouched: deque[bool] = field(default_factory=lambda: deque(maxlen=HITS_WINDOW))
    # Per recent judged prediction: whether it was stale.
    judged_stale: deque[bool] = field(default_factory=lambda: deque(maxlen=JUDGED_WINDOW))

    def suspect(self, after_misses: int) -> bool:
        judged = len(self.judged_stale)
        return self.misses_in_a_row >= after_misses or (
            judged >= JUDGED_WINDOW // 2 and 2 * sum(self.judged_stale) >= judged
        )


@dataclass(slots=True)
class _Standing:
    """What a worker id has shown across its incarnations, kept while it turned suspect
    within the suspicion window."""

    suspected_at: deque[float] = field(default_factory=deque)  # on the clock, oldest first
    # Per recent judged prediction, whatever the incarnation: whether it was stale.
    judged_stale: deque[bool] = field(default_factory=lambda: deque(maxlen=STANDING_WINDOW))

    def mostly_stale(self) -> bool:
        return 2 * sum(self.judged_stale) >= len(self.judged_stale) > 0


class PredictionAccuracy:
    def __init__(
        self,
        suspect_after_misses: int,
        tolerance_tokens: int,
        *,
        withdraw_after_suspicions: int = 3,
        suspicion_window_s: float = 3600.0,
        withdrawal_s: float = 900.0,
        clock: Clock = time.monotonic,
        on_suspect: Callable[[str], None] = lambda worker_id: None,
    ) -> None:
        """`on_suspect(worker_id)` runs each time a worker turns suspect."""
        self.suspect_after_misses = suspect_after_misses
        self.tolerance_tokens = tolerance_tokens
        self.withdraw_after_suspicions = withdraw_after_suspicions
        self.suspicion_window_s = suspicion_window_s
        self.withdrawal_s = withdrawal_s
        self._clock = clock
        self._on_suspect = on_suspect
        self._records: dict[str, _Record] = {}
        self._standings: dict[str, _Standing] = {}
        self._withdrawn_until: dict[str, float] = {}  # on the clock
        self._changed: set[str] = set()

    def take_changed(self) -> set[str]:
        """The workers whose suspicion may have changed since the last call (one reader
        only): the router's WorkerPool keeps it as a column and re-reads only those.
        Withdrawals that have run out are ended here."""
        if self._withdrawn_until:  # almost always empty: this runs before every decision
            now = self._clock()
            for worker_id, until in list(self._withdrawn_until.items()):
                if until <= now:
                    del self._withdrawn_until[worker_id]
                    self._changed.add(worker_id)
        changed, self._changed = self._changed, set()
        return changed

    def observe(
        self,
        worker_id: str,
        incarnation: int,
        predicted_tokens: int,
        reported_tokens: int,
        *,
        self_predicted_tokens: int = 0,
    ) -> Verdict:
        """`predicted_tokens`: what the worker's index entries vouched for;
        `self_predicted_tokens`: what only this router's predicted entries added."""
        record = self._records.get(worker_id)
        if record is None or record.incarnation != incarnation:
            record = self._records[worker_id] = _Record(incarnation)
            self._changed.add(worker_id)
        if reported_tokens > self.tolerance_tokens and (predicted_tokens or self_predicted_tokens):
            record.hits_vouched.append(predicted_tokens > 0)
        verdict = judge(predicted_tokens, reported_tokens, self.tolerance_tokens)
        suspected = record.suspect(self.suspect_after_misses)
        if predicted_tokens > 0:
            record.judged_stale.append(verdict is Verdict.STALE)
            standing = self._standings.get(worker_id)
            if standing is not None:
                standing.judged_stale.append(verdict is Verdict.STALE)
        if verdict is Verdict.STALE:
            record.misses_in_a_row += 1
        elif predicted_tokens > 0 or verdict is Verdict.BETTER:
            # Only a prediction of something, borne out, clears a suspicion.
            record.misses_in_a_row = 0
        if suspected != record.suspect(self.suspect_after_misses):
            self._changed.add(worker_id)
            if not suspected:
                self._turned_suspect(worker_id)
        return verdict

    def _turned_suspect(self, worker_id: str) -> None:
        self._on_suspect(worker_id)
        now = self._clock()
        standing = self._standings.get(worker_id)
        if standing is None:  # its history starts with this incarnation's verdicts
            standing = self._standings[worker_id] = _Standing()
            standing.judged_stale.extend(self._records[worker_id].judged_stale)
        standing.suspected_at.append(now)
        while standing.suspected_at[0] < now - self.suspicion_window_s:
            standing.suspected_at.popleft()
        if len(standing.suspected_at) >= self.withdraw_after_suspicions and (
            standing.mostly_stale()
        ):
            standing.suspected_at.clear()
            self._withdrawn_until[worker_id] = now + self.withdrawal_s

    def is_suspect(self, worker_id: str, incarnation: int) -> bool:
        """Whether the worker's index entries count for nothing now: its predictions
        keep failing, or its credit is withdrawn."""
        if self.withdrawn_until(worker_id) is not None:
            return True
        record = self._records.get(worker_id)
        return (
            record is not None
            and record.incarnation == incarnation
            and record.suspect(self.suspect_after_misses)
        )

    def withdrawn_until(self, worker_id: str) -> float | None:
        """When the worker's withdrawn cache credit comes back (on the clock); None
        while it stands."""
        until = self._withdrawn_until.get(worker_id)
        return until if until is not None and until > self._clock() else None

    def vouching(self, worker_id: str, incarnation: int) -> tuple[int, int]:
        """Of the worker's recent predicted hits: how many, and how many its index
        entries vouched for."""
        record = self._records.get(worker_id)
        if record is None or record.incarnation != incarnation:
            return 0, 0
        return len(record.hits_vouched), sum(record.hits_vouched)

    def forget(self, worker_id: str) -> None:
        """The worker's entries are gone (new incarnation, resync, death); its standing
        (recent suspicions, a withdrawal) stays with its id while it matters."""
        if self._records.pop(worker_id, None) is not None:
            self._changed.add(worker_id)
        standing = self._standings.get(worker_id)
        if standing is not None and (
            not standing.suspected_at
            or standing.suspected_at[-1] < self._clock() - self.suspicion_window_s
        ):
            del self._standings[worker_id]

    def suspects(self) -> set[str]:
        suspect = {
            worker_id
            for worker_id, record in self._records.items()
            if record.suspect(self.suspect_after_misses)
        }
        return suspect | self.withdrawn()

    def withdrawn(self) -> set[str]:
        """The workers whose cache credit is withdrawn now."""
        return {worker_id for worker_id in self._withdrawn_until if self.withdrawn_until(worker_id)}
