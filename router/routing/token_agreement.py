"""Does the router tokenise as each engine does? Its prompt token count against the
`usage.prompt_tokens` the engine answers with.

A router whose tokenizer or chat template differs from the engine's computes block keys
that no engine event ever carries: the index never matches, and routing falls back on
the router's own predicted entries (approximate, like a text tree) while looking
precise. Token counts that differ on a worker's recent requests are the cheap, certain
sign of it. Counts, never text: nothing of a prompt is kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvplane.core.types import Incarnation

WINDOW = 32
"""Comparisons kept per worker: the verdict follows the recent requests."""
MIN_SAMPLES = 4
WARN_EVERY_S = 60.0
MAX_MISMATCH_SHARE = 0.25
"""Above this share of differing counts, the worker's tokenisation disagrees. Not zero:
an engine may count a request differently for reasons of its own (a prompt it cut to
its context length, say), and one such request must not condemn a fleet."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """A worker's recent comparisons; the last difference, for the operator."""

    samples: int
    mismatches: int
    last_router_tokens: int | None  # of the last request whose counts differed
    last_engine_tokens: int | None

    @property
    def disagrees(self) -> bool:
        return self.samples >= MIN_SAMPLES and self.mismatches > MAX_MISMATCH_SHARE * self.samples

    @property
    def agrees(self) -> bool:
        return self.samples >= MIN_SAMPLES and not self.disagrees


@dataclass(slots=True)
class _Window:
    matched: deque[bool] = field(default_factory=lambda: deque(maxlen=WINDOW))
    last_difference: tuple[int, int] | None = None
    warned_at: float | None = None


class TokenCountAgreement:
    def __init__(self) -> None:
        self._windows: dict[Incarnation, _Window] = {}

    def observe(self, worker: Incarnation, router_tokens: int, engine_tokens: int) -> bool:
        """Record one request's counts; whether they were equal."""
        window = self._windows.setdefault(worker, _Window())
        matched = router_tokens == engine_tokens
        window.matched.append(matched)
        if not matched:
            window.last_difference = (router_tokens, engine_tokens)
        return matched

    def of(self, worker: Incarnation) -> Agreement:
        window = self._windows.get(worker)
        if window is None:
            return Agreement(0, 0, None, None)
        router_tokens, engine_tokens = window.last_difference or (None, None)
        return Agreement(
            samples=len(window.matched),
            mismatches=window.matched.count(False),
            last_router_tokens=router_tokens,
            last_engine_tokens=engine_tokens,
        )

    def warning_due(self, worker: Incarnation, now: float) -> bool:
        """The worker disagrees and was not warned about within WARN_EVERY_S (a warning
        is then taken as given)."""
        window = self._windows.get(worker)
        if window is None or not self.of(worker).disagrees:
            return False
        if window.warned_at is not None and now - window.warned_at < WARN_EVERY_S:
            return False
        window.warned_at = now
        return True

    def retain(self, current: Iterable[Incarnation]) -> None:
        """Forget every worker incarnation but `current` (the registry's)."""
        keep = set(current)
        for worker in [worker for worker in self._windows if worker not in keep]:
            del self._windows[worker]
