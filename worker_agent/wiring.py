"""Does the engine's KV event stream really reach this agent? The agent's proof of its
own wiring, judged once per load interval and sent to the control plane with the load.

A fleet can run for ever with every agent registered and not one event arriving: vLLM
and SGLang *connect* to a concrete event endpoint (`tcp://127.0.0.1:5557`) instead of
binding it, the agent's SUB socket connects too, and ZMQ reports no error on either
side. So the agent proves each link and says so, with the fix:
- the event socket: a publisher must complete the handshake within `connect_grace_s`
  of the agent subscribing (or of the last publisher going away);
- the replay socket: the request made at start (and any later one) must be answered;
- the stream itself: an engine whose counters prove that it cached a new block at least
  `silent_after_s` ago, with no event since, is "silent". Proof, not a hint: by some
  moment it had computed more prompt tokens than (block size - 1) times the requests it
  has prefilled since the last event (counted now, so that requests still in their
  prefill then are counted too), so at least one request computed a whole block, which
  a prefix-caching engine caches and announces. Repeated prompts that compute a few
  tokens each never add up to that.

`assess` is the pure judgement; `WiringWatch` keeps the little state it needs (the
engine's counters since the last event) and logs changes, and repeats a problem at most
once per `LOG_REPEAT_S`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from kvplane.core.types import EventsState, ReplayState, WiringReport
from worker_agent.events import PrefixCacheCounters

log = logging.getLogger(__name__)

LOG_REPEAT_S = 60.0


@dataclass(frozen=True, slots=True)
class SourceFacts:
    """What the event source saw, times on the agent's clock."""

    endpoint: str
    replay_endpoint: str | None
    subscribed: bool
    unconnected_since: float | None  # None: a publisher is on the other end
    last_batch_at: float | None
    replay_answered: bool | None  # None: no replay request made yet
    replay_timeout_s: float


@dataclass(frozen=True, slots=True)
class SilenceFacts:
    """Since the last event: the earliest moment by which the engine's counters prove
    that it cached a new block (see the module's docstring); None if they do not."""

    cached_since: float | None


def bind_hint(endpoint: str, config_field: str) -> str:
    """The fix for an endpoint nothing binds: which side must bind, and how."""
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[-1]
        return (
            f'the engine must bind it: set "{config_field}": "tcp://*:{port}" in its '
            "--kv-events-config (given a concrete address such as 127.0.0.1, vLLM and "
            "SGLang connect instead of binding)"
        )
    return (
        f'the engine must bind it: check "{config_field}" in the engine\'s '
        "--kv-events-config and that the agent names the same endpoint"
    )


def assess(
    source: SourceFacts,
    silence: SilenceFacts,
    *,
    engine_block_size: int | None,
    connect_grace_s: float,
    silent_after_s: float,
    now: float,
) -> WiringReport:
    events, detail = _events_state(source, silence, connect_grace_s, silent_after_s, now)
    replay, replay_detail = _replay_state(source)
    return WiringReport(
        events=events,
        replay=replay,
        engine_block_size=engine_block_size,
        events_detail=detail,
        replay_detail=replay_detail,
    )


def _events_state(
    source: SourceFacts,
    silence: SilenceFacts,
    connect_grace_s: float,
    silent_after_s: float,
    now: float,
) -> tuple[EventsState, str]:
    if not source.subscribed:
        return EventsState.UNKNOWN, ""
    if source.unconnected_since is not None:
        # Batches may still be coming in from replay alone; the live stream is what counts.
        if now - source.unconnected_since < connect_grace_s:
            return EventsState.UNKNOWN, ""
        return EventsState.NOT_CONNECTED, (
            f"no KV event publisher accepted a connection at {source.endpoint} for "
            f"{now - source.unconnected_since:.0f} s: " + bind_hint(source.endpoint, "endpoint")
        )
    if silence.cached_since is not None and now - silence.cached_since >= silent_after_s:
        return EventsState.SILENT, (
            f"the engine cached new blocks but no KV event arrived at {source.endpoint} for "
            f"{now - silence.cached_since:.0f} s: check that the engine runs with "
            "--enable-prefix-caching and enable_kv_cache_events, that its topic matches "
            "the agent's, and that the agent is beside the engine it reads"
        )
    if source.last_batch_at is None:
        return EventsState.NEVER_SEEN, ""
    return EventsState.FLOWING, ""


def _replay_state(source: SourceFacts) -> tuple[ReplayState, str]:
    if source.replay_endpoint is None:
        return ReplayState.NOT_CONFIGURED, ""
    if source.replay_answered is None:
        return ReplayState.UNKNOWN, ""
    if source.replay_answered:
        return ReplayState.OK, ""
    return ReplayState.FAILING, (
        f"the replay endpoint {source.replay_endpoint} did not answer a replay request "
        f"whole (each reply within {source.replay_timeout_s:g} s, well formed): "
        + bind_hint(source.replay_endpoint, "replay_endpoint")
    )


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    computed_tokens: float
    prefilled_requests: float


_SAMPLES_KEPT = 1024
"""Samples of the counters since the last event, each one that moved. Dropping the
oldest only delays a verdict of silence; it never brings one about."""


class WiringWatch:
    """The engine's counters since the last event, and the log lines (changes, and a
    problem repeated at most once per LOG_REPEAT_S)."""

    def __init__(
        self,
        *,
        connect_grace_s: float,
        silent_after_s: float,
        engine_block_size: int | None,
        block_tokens: int,
    ) -> None:
        """`block_tokens`: the engine's block size, or the router's where the engine
        does not say (the engine's divides it, so the rule stays sound, only slower)."""
        self.connect_grace_s = connect_grace_s
        self.silent_after_s = silent_after_s
        self.engine_block_size = engine_block_size
        self._block_tokens = block_tokens
        self._batch_seen_at: float | None = None
        self._baseline: _Sample | None = None  # the engine's counters at the last event
        self._samples: deque[_Sample] = deque(maxlen=_SAMPLES_KEPT)
        self._prefilled_now = 0.0  # the engine's prefilled requests at the last probe
        self._logged: WiringReport | None = None
        self._logged_at = 0.0

    def observe(
        self, source: SourceFacts, counters: PrefixCacheCounters | None, now: float
    ) -> WiringReport:
        self._follow_counters(source.last_batch_at, counters, now)
        report = assess(
            source,
            SilenceFacts(self._cached_since()),
            engine_block_size=self.engine_block_size,
            connect_grace_s=self.connect_grace_s,
            silent_after_s=self.silent_after_s,
            now=now,
        )
        self._log(report, now)
        return report

    def _follow_counters(
        self, last_batch_at: float | None, counters: PrefixCacheCounters | None, now: float
    ) -> None:
        if counters is None:
            return  # unreadable this time: judged on the next probe
        sample = _Sample(now, counters.computed_tokens, counters.prefilled_requests)
        baseline = self._baseline
        if (
            baseline is None
            or last_batch_at != self._batch_seen_at
            # The counters started again: a restarted engine.
            or sample.computed_tokens < baseline.computed_tokens
            or sample.prefilled_requests < baseline.prefilled_requests
        ):
            self._baseline, self._batch_seen_at = sample, last_batch_at
            self._samples.clear()
            self._prefilled_now = sample.prefilled_requests
            return
        self._prefilled_now = sample.prefilled_requests
        last = self._samples[-1] if self._samples else baseline
        if sample.computed_tokens != last.computed_tokens:  # an idle engine adds nothing
            self._samples.append(sample)

    def _cached_since(self) -> float | None:
        baseline = self._baseline
        if baseline is None or not self._samples:
            return None
        prefilled = self._prefilled_now - baseline.prefilled_requests
        if prefilled < 1:
            return None
        threshold = (self._block_tokens - 1) * prefilled
        for sample in self._samples:  # oldest first; computed tokens only grow
            if sample.computed_tokens - baseline.computed_tokens > threshold:
                return sample.at
        return None

    def _log(self, report: WiringReport, now: float) -> None:
        problem = report.events in (EventsState.NOT_CONNECTED, EventsState.SILENT) or (
            report.replay is ReplayState.FAILING
        )
        previous = self._logged
        changed = previous is None or (previous.events, previous.replay) != (
            report.events,
            report.replay,
        )
        if not (changed or (problem and now - self._logged_at >= LOG_REPEAT_S)):
            return
        states = f"wiring: events {report.events.value}, replay {report.replay.value}"
        if problem:
            details = (report.events_detail, report.replay_detail)
            log.warning("%s: %s", states, "; ".join(part for part in details if part))
        elif previous is not None:  # a change for the better; nothing to say at start
            log.info("%s", states)
        self._logged, self._logged_at = report, now
