"""Does the engine's KV event stream really reach this agent? The agent's proof of its
own wiring, judged once per load interval and sent to the control plane with the load.

A fleet can run for ever with every agent registered and not one event arriving: vLLM
and SGLang *connect* to a concrete event endpoint (`tcp://127.0.0.1:5557`) instead of
binding it, the agent's SUB socket connects too, and ZMQ reports no error on either
side. So the agent proves each link and says so, with the fix:
- the event socket: a publisher must complete the handshake within `connect_grace_s`;
- the replay socket: the request made at start (and any later one) must be answered;
- the stream itself: an engine that computed at least a block of new prompt tokens
  (its prefix-cache counters, from the /metrics the agent reads anyway) with no event
  for `silent_after_s` is "silent".

`assess` is the pure judgement; `WiringWatch` keeps the little state it needs (the
engine's counters when the last event came) and logs changes, and repeats a problem at
most once per `LOG_REPEAT_S`.
"""

from __future__ import annotations

import logging
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
    subscribed_at: float | None  # None: not subscribed yet
    connected: bool
    last_batch_at: float | None
    replay_answered: bool | None  # None: no replay request made yet
    replay_timeout_s: float


@dataclass(frozen=True, slots=True)
class SilenceFacts:
    """Since the last event (or since the agent started): when the engine was first seen
    to have computed a block's worth of new prompt tokens; None if it has not."""

    computing_since: float | None


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
    if source.subscribed_at is None:
        return EventsState.UNKNOWN, ""
    if not source.connected:
        # Batches may still be coming in from replay alone; the live stream is what counts.
        if now - source.subscribed_at < connect_grace_s:
            return EventsState.UNKNOWN, ""
        return EventsState.NOT_CONNECTED, (
            f"no KV event publisher accepted a connection at {source.endpoint}: "
            + bind_hint(source.endpoint, "endpoint")
        )
    if silence.computing_since is not None and now - silence.computing_since >= silent_after_s:
        return EventsState.SILENT, (
            f"the engine computed new prompt tokens but no KV event arrived at "
            f"{source.endpoint} for {now - silence.computing_since:.0f} s: check that the "
            "engine runs with --enable-prefix-caching and enable_kv_cache_events, that its "
            "topic matches the agent's, and that the agent is beside the engine it reads"
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
        f"within {source.replay_timeout_s:g} s: "
        + bind_hint(source.replay_endpoint, "replay_endpoint")
    )


class WiringWatch:
    """The silence baseline between probes, and the log lines (changes, and a problem
    repeated at most once per LOG_REPEAT_S)."""

    def __init__(
        self,
        *,
        connect_grace_s: float,
        silent_after_s: float,
        engine_block_size: int | None,
        computed_tokens_threshold: int,
    ) -> None:
        self.connect_grace_s = connect_grace_s
        self.silent_after_s = silent_after_s
        self.engine_block_size = engine_block_size
        # A block of new prompt tokens makes an engine cache (and announce) at least one
        # block; fewer may make none.
        self._threshold = computed_tokens_threshold
        self._baseline: float | None = None  # the engine's computed tokens at the last event
        self._batch_seen_at: float | None = None
        self._computing_since: float | None = None
        self._logged: WiringReport | None = None
        self._logged_at = 0.0
        self.report: WiringReport | None = None

    def observe(
        self, source: SourceFacts, counters: PrefixCacheCounters | None, now: float
    ) -> WiringReport:
        self._follow_counters(source.last_batch_at, counters, now)
        self.report = assess(
            source,
            SilenceFacts(self._computing_since),
            engine_block_size=self.engine_block_size,
            connect_grace_s=self.connect_grace_s,
            silent_after_s=self.silent_after_s,
            now=now,
        )
        self._log(self.report, now)
        return self.report

    def _follow_counters(
        self, last_batch_at: float | None, counters: PrefixCacheCounters | None, now: float
    ) -> None:
        if counters is None:
            return
        computed = counters.computed_tokens
        if (
            self._baseline is None
            or last_batch_at != self._batch_seen_at
            or computed < self._baseline  # the counters started again: a restarted engine
        ):
            self._baseline, self._batch_seen_at = computed, last_batch_at
            self._computing_since = None
        elif self._computing_since is None and computed - self._baseline >= self._threshold:
            self._computing_since = now

    def _log(self, report: WiringReport, now: float) -> None:
        problem = report.events in (EventsState.NOT_CONNECTED, EventsState.SILENT) or (
            report.replay is ReplayState.FAILING
        )
        previous = self._logged
        changed = previous is None or (previous.events, previous.replay) != (
            report.events,
            report.replay,
        )
        if problem and (changed or now - self._logged_at >= LOG_REPEAT_S):
            log.warning(
                "wiring: events %s, replay %s: %s",
                report.events.value,
                report.replay.value,
                "; ".join(part for part in (report.events_detail, report.replay_detail) if part),
            )
            self._logged, self._logged_at = report, now
        elif changed and not problem and previous is not None:
            log.info("wiring: events %s, replay %s", report.events.value, report.replay.value)
            self._logged, self._logged_at = report, now
        elif previous is None:
            self._logged, self._logged_at = report, now
