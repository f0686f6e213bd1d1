"""Checking the router's predictions against what engines report.

After a response, the engine's `usage.prompt_tokens_details.cached_tokens` (when it
sends one) says how much of the prompt it really found cached. A report that falls
short of the prediction by more than the tolerance (one engine block: engines count
in their own blocks, and recompute a fully cached prompt's last token) is a stale
location: the index believed in blocks the engine no longer had. A worker whose
predictions keep failing has suspect index entries: scoring stops counting on them
until a prediction holds again or the worker starts a new incarnation.

Only the part of a prediction that the worker's own events vouched for (its index
entries) is judged: the rest came from this router's predicted entries, which are its
own guesses. A worker whose engine keeps reporting hits that only those guesses
foresaw is *unvouched* (router/routing/wiring.py judges it): its events are not reaching
the index (or carry other keys), and routing there is approximate, however well the
guesses do.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


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


@dataclass(slots=True)
class _Record:
    incarnation: int
    misses_in_a_row: int = 0
    # Per recent hit: whether the worker's index entries vouched for any of it.
    hits_vouched: deque[bool] = field(default_factory=lambda: deque(maxlen=HITS_WINDOW))


class PredictionAccuracy:
    def __init__(self, suspect_after_misses: int, tolerance_tokens: int) -> None:
        self.suspect_after_misses = suspect_after_misses
        self.tolerance_tokens = tolerance_tokens
        self._records: dict[str, _Record] = {}
        self._changed: set[str] = set()

    def take_changed(self) -> set[str]:
        """The workers whose suspicion may have changed since the last call (one reader
        only): the router's Fleet keeps it as a column and re-reads only those."""
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
        suspected = record.misses_in_a_row >= self.suspect_after_misses
        if verdict is Verdict.STALE:
            record.misses_in_a_row += 1
        elif predicted_tokens > 0 or verdict is Verdict.BETTER:
            # Only a prediction of something, borne out, clears a suspicion.
            record.misses_in_a_row = 0
        if suspected != (record.misses_in_a_row >= self.suspect_after_misses):
            self._changed.add(worker_id)
        return verdict

    def is_suspect(self, worker_id: str, incarnation: int) -> bool:
        record = self._records.get(worker_id)
        return (
            record is not None
            and record.incarnation == incarnation
            and record.misses_in_a_row >= self.suspect_after_misses
        )

    def vouching(self, worker_id: str, incarnation: int) -> tuple[int, int]:
        """Of the worker's recent predicted hits: how many, and how many its index
        entries vouched for."""
        record = self._records.get(worker_id)
        if record is None or record.incarnation != incarnation:
            return 0, 0
        return len(record.hits_vouched), sum(record.hits_vouched)

    def forget(self, worker_id: str) -> None:
        """The worker's entries are gone (new incarnation, resync, death)."""
        if self._records.pop(worker_id, None) is not None:
            self._changed.add(worker_id)

    def suspects(self) -> set[str]:
        return {
            worker_id
            for worker_id, record in self._records.items()
            if record.misses_in_a_row >= self.suspect_after_misses
        }
