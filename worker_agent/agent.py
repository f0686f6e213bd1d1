"""`kvplane agent`: wires the engine adapter, event source, translator and publisher.

Three tasks share one event loop: events (source -> translator -> publisher), the
engine watch (health probe and load report every `load_interval_s`; the load scrape
every `idle_metrics_interval_s` instead while the engine is idle) and the control plane
stream. Anything that breaks the agent's picture of the engine (lost state, an engine
restart or outage, an overgrown map) clears the translator and starts a new
incarnation, so the control plane never keeps what the engine no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp

from kvplane.core.config import Settings
from kvplane.core.kv_transfer import KvTransferConfig, parse_kv_transfer_config, worker_role
from kvplane.core.types import SkippedEvents, WiringReport
from kvplane.wire.codec import MAX_ENGINE_FIELD_CHARS
from worker_agent.engines import adapter_for
from worker_agent.engines.base import EngineAdapter, process_start_time
from worker_agent.events import EngineCacheConfig, EngineLoad
from worker_agent.kv_event_source import KvEventSource, StateLost
from worker_agent.publisher import ControlPlanePublisher, PublisherRejected, WorkerIdentity
from worker_agent.translate import BlockTranslator, TrackingLimitExceeded
from worker_agent.wiring import SourceFacts, WiringWatch

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0
_COUNTERS_LOG_INTERVAL_S = 60.0


class _EngineFacts(NamedTuple):
    model: str
    max_model_len: int
    cache: EngineCacheConfig | None
    kv_transfer: KvTransferConfig | None


def tune_garbage_collector() -> None:
    """For the agent's process: it keeps one object per engine block it tracks (millions
    on a large engine), and CPython's default thresholds (a young collection every 700
    allocations) cost it a third of its ingest rate. Collections stay on, rarer."""
    gc.set_threshold(100_000, 50, 100)


class WorkerAgent:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.adapter: EngineAdapter = adapter_for(settings.agent.engine)
        self.translator: BlockTranslator | None = None
        self.publisher: ControlPlanePublisher | None = None
        self.wiring: WiringWatch | None = None
        self.engine_is_down = False
        self.metrics_reads = 0  # of the engine's /metrics so far: an idle one's are fewer

    async def run(self) -> None:
        agent = self.settings.agent
        async with _EngineHttp(agent.engine_url) as http:
            model, max_model_len, cache, kv_transfer = await self._engine_facts(http)
            role, kv_connector = worker_role(agent.role, kv_transfer)
            version = await _engine_version(http, self.adapter.version_path)
            for warning in self.adapter.release_warnings(version):
                log.warning("%s", warning)
            router_block = self.settings.control_plane.block_size
            if cache is not None and cache.block_size and router_block % cache.block_size:
                log.error(
                    "the engine's block size %d does not divide the router's %d: no block "
                    "can be keyed; set control_plane.block_size to a multiple of it",
                    cache.block_size,
                    router_block,
                )
            log.info(
                "keying %s events of model %s in router blocks of %d tokens (engine blocks "
                "of %s); of a hybrid model's KV cache groups only group 0 (full attention) "
                "is followed, the others' events are counted and dropped",
                self.adapter.kind,
                model,
                router_block,
                cache.block_size if cache is not None and cache.block_size else "unknown size",
            )
            self.translator = BlockTranslator(
                model,
                self.settings.control_plane.block_size,
                max_tracked_blocks=agent.max_tracked_blocks,
            )
            self.publisher = ControlPlanePublisher(
                WorkerIdentity(
                    worker_id=agent.worker_id,
                    base_url=agent.advertise_url or agent.engine_url,
                    model=model,
                    block_size=self.settings.control_plane.block_size,
                    kv_capacity_blocks=(cache.num_blocks or 0) if cache else 0,
                    engine_kind=self.adapter.kind,
                    engine_version=version,
                    labels=dict(agent.labels),
                    max_model_len=max_model_len,
                    role=role,
                    kv_connector=kv_connector,
                ),
                agent,
                self.settings.control_plane,
                snapshot=self.translator.snapshot,
            )
            source = KvEventSource(
                self.adapter,
                agent.kv_events_endpoint,
                replay_endpoint=agent.kv_events_replay_endpoint,
                topic=agent.kv_events_topic,
                replay_timeout_s=agent.replay_timeout_s,
                gather_s=agent.batch_linger_s,
            )
            engine_block = cache.block_size if cache is not None else None
            self.wiring = WiringWatch(
                connect_grace_s=agent.events_connect_grace_s,
                silent_after_s=agent.events_silent_after_s,
                engine_block_size=engine_block,
                block_tokens=engine_block or router_block,
            )
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self.publisher.run())
                    tasks.create_task(self._forward_events(source, self.translator, self.publisher))
                    tasks.create_task(
                        self._watch_engine(http, source, self.translator, self.publisher)
                    )
            except* PublisherRejected as group:
                raise group.exceptions[0] from None
            finally:
                source.close()

    async def _engine_facts(self, http: _EngineHttp) -> _EngineFacts:
        """The model name (configured, or the engine's first), its longest prompt plus
        output (0 when the engine does not say), its cache configuration and its KV
        transfer configuration (its metrics', else the configured); waits for the
        engine to answer."""
        delay = self.settings.agent.reconnect_min_s
        configured = self.settings.agent.kv_transfer_config
        while True:
            try:
                served = await _served_models(http, required=self.settings.agent.model is None)
                model = self.settings.agent.model or str(served[0]["id"])
                async with http.get("/metrics") as response:
                    metrics_text = await response.text()
                cache = self.adapter.parse_cache_config(metrics_text)
                kv_transfer = self.adapter.parse_kv_transfer_config(metrics_text)
                if kv_transfer is None and configured is not None:
                    kv_transfer = parse_kv_transfer_config(configured)  # validated already
                return _EngineFacts(model, _max_model_len(served, model), cache, kv_transfer)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as error:
                log.info(
                    "waiting for the engine at %s (%s)",
                    self.settings.agent.engine_url,
                    type(error).__name__,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.settings.agent.reconnect_max_s)

    async def _forward_events(
        self,
        source: KvEventSource,
        translator: BlockTranslator,
        publisher: ControlPlanePublisher,
    ) -> None:
        # Closed here, not left to the garbage collector: its sockets must close before
        # the source's context does.
        async with contextlib.aclosing(source.items()) as items:
            async for item in items:
                if isinstance(item, StateLost):
                    _start_over(item.reason, translator, publisher)
                    continue
                try:
                    publisher.submit(translator.translate(item.events))
                except TrackingLimitExceeded as error:
                    _start_over(str(error), translator, publisher)

    async def _watch_engine(
        self,
        http: _EngineHttp,
        source: KvEventSource,
        translator: BlockTranslator,
        publisher: ControlPlanePublisher,
    ) -> None:
        """Probe the engine every load interval: down and up, a restart in place (its
        process start time changed), and its load for the heartbeats (read less often
        while the engine is idle)."""
        agent = self.settings.agent
        failures = 0
        started_at: float | None = None
        unread_metrics: str | None = None  # why the last probe could not read them
        load = EngineLoad(0, 0, 0.0)
        batch_seen_at: float | None = None  # the source's last batch, at the last read
        reported = dataclasses.replace(translator.counters)
        skipped = source.skipped_events.copy()
        next_report = time.monotonic() + _COUNTERS_LOG_INTERVAL_S
        metrics_due = 0.0  # while the engine is idle: when its metrics are read next
        while True:
            if time.monotonic() >= next_report:
                next_report += _COUNTERS_LOG_INTERVAL_S
                if translator.counters != reported:
                    reported = dataclasses.replace(translator.counters)
                    log.info("translation so far: %s", dataclasses.asdict(reported))
                if source.skipped_events != skipped:
                    skipped = source.skipped_events.copy()
                    log.info(
                        "events skipped so far: %s",
                        ", ".join(
                            f"{e.event_type} ({e.reason.value}): {n}" for e, n in skipped.items()
                        ),
                    )
            # While the engine stays idle (no event since), /health alone: the last load
            # stands and goes out again as the heartbeat.
            read_metrics = time.monotonic() >= metrics_due or source.last_batch_at != batch_seen_at
            healthy, metrics, metrics_error = await _probe(http, read_metrics=read_metrics)
            self.metrics_reads += read_metrics
            failures = 0 if healthy else failures + 1
            # Logged as it changes (an engine that is down says nothing of its metrics).
            if read_metrics and healthy and (metrics_error is None) != (unread_metrics is None):
                if metrics_error is not None:
                    log.warning(
                        "the engine's metrics could not be read (%s): load reports repeat "
                        "the last until they can",
                        metrics_error,
                    )
                else:
                    log.info("the engine's metrics can be read again")
                unread_metrics = metrics_error
            if failures >= agent.engine_down_after_failures and not self.engine_is_down:
                log.warning("the engine at %s is down; publishing stops", agent.engine_url)
                self.engine_is_down = True
                started_at = None  # its next life's start time is not a restart
                translator.clear()
                source.engine_went_down()
            elif healthy:
                start = None if metrics is None else process_start_time(metrics)
                if self.engine_is_down:
                    log.info("the engine at %s is back", agent.engine_url)
                    self.engine_is_down = False
                    # The translator was cleared when the engine went down: what it holds
                    # now came from the engine's new life, and goes into the new incarnation.
                    publisher.engine_up()
                elif None not in (start, started_at) and start != started_at:
                    # Restarted between two probes: the cache and the event sequence
                    # started again, whatever the events have shown so far.
                    translator.clear()
                    source.engine_went_down()
                    _start_over("the engine process restarted", translator, publisher)
                started_at = start if start is not None else started_at
                if metrics is not None:  # else the last load and wiring verdict stand
                    try:
                        load = self.adapter.parse_load(metrics)
                    except ValueError as error:
                        log.warning(
                            "no load from the engine's metrics (%s): the last is sent", error
                        )
                    publisher.report_wiring(self._judge_wiring(source, metrics))
            if self.engine_is_down:
                publisher.report_engine_down()
            elif healthy:
                publisher.report_load(load)  # a heartbeat whether or not the metrics parsed
            if read_metrics:
                idle = (
                    healthy
                    and metrics is not None
                    and is_idle(load, source.last_batch_at, batch_seen_at)
                )
                batch_seen_at = source.last_batch_at
                metrics_due = time.monotonic() + agent.idle_metrics_interval_s if idle else 0.0
            await asyncio.sleep(agent.load_interval_s)

    def _judge_wiring(self, source: KvEventSource, metrics: str) -> WiringReport:
        assert self.wiring is not None
        try:
            counters = self.adapter.parse_prefix_cache(metrics)
        except ValueError:
            counters = None  # unreadable this time: silence is judged on the next probe
        facts = SourceFacts(
            endpoint=source.endpoint,
            replay_endpoint=source.replay_endpoint,
            subscribed=source.subscribed_at is not None,
            unconnected_since=source.unconnected_since,
            last_batch_at=source.last_batch_at,
            replay_answered=source.replay_answered,
            replay_timeout_s=self.settings.agent.replay_timeout_s,
        )
        report = self.wiring.observe(facts, counters, time.monotonic())
        skipped = tuple(
            SkippedEvents(kind.event_type, kind.reason, count)
            for kind, count in source.skipped_events.items()
        )
        return dataclasses.replace(report, skipped_events=skipped)


class _EngineHttp:
    """The agent's keep-alive connection to its engine, by path (the engine's URL may
    carry a path prefix). aiohttp rather than httpx: the probe runs every load interval
    in every agent, and httpx's client was most of an idle agent's CPU."""

    def __init__(self, engine_url: str) -> None:
        self._base = engine_url.rstrip("/")
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S),
            skip_auto_headers=("User-Agent",),
        )

    @contextlib.asynccontextmanager
    async def get(self, path: str) -> AsyncIterator[aiohttp.ClientResponse]:
        async with self._session.get(self._base + path) as response:
            yield response

    async def __aenter__(self) -> _EngineHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()


async def _served_models(http: _EngineHttp, *, required: bool) -> Any:
    """The `data` of the engine's /v1/models; where the model is configured, an engine
    without the route gives an empty list (its max_model_len is then unknown)."""
    try:
        async with http.get("/v1/models") as response:
            response.raise_for_status()
            return (await response.json(content_type=None))["data"]
    except (aiohttp.ClientResponseError, ValueError, KeyError):
        if required:
            raise
        return []


def _max_model_len(served: Any, model: str) -> int:
    """The `max_model_len` that vLLM and SGLang give each model in /v1/models; 0 when
    the model is not listed or the field is not a positive integer that fits the wire."""
    for entry in served if isinstance(served, list) else ():
        if isinstance(entry, dict) and entry.get("id") == model:
            length = entry.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and 0 < length < 2**32:
                return length
    return 0


async def _engine_version(http: _EngineHttp, path: str) -> str:
    """The engine's release as it says at `path` ("" if it does not: the version only
    informs operators and the warnings above)."""
    try:
        async with http.get(path) as response:
            response.raise_for_status()
            version = (await response.json(content_type=None)).get("version")
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return ""
    if not isinstance(version, str) or not version.isprintable():
        return ""
    return version[:MAX_ENGINE_FIELD_CHARS]


class _Probe(NamedTuple):
    healthy: bool
    metrics: str | None  # None: not read (unhealthy, or the read failed)
    metrics_error: str | None = None  # why a healthy engine's metrics were not read


async def _probe(http: _EngineHttp, *, read_metrics: bool) -> _Probe:
    """/health alone says whether the engine is up: metrics that fail, time out or do
    not parse cost the load report, not the engine. Without `read_metrics`, /health
    only (metrics None, with no error)."""
    try:
        async with http.get("/health") as health:
            if health.status != 200:
                return _Probe(False, None)
    except (aiohttp.ClientError, TimeoutError):
        return _Probe(False, None)
    if not read_metrics:
        return _Probe(True, None)
    try:
        async with http.get("/metrics") as metrics:
            if metrics.status != 200:
                return _Probe(True, None, f"HTTP {metrics.status}")
            return _Probe(True, await metrics.text(errors="replace"))
    except (aiohttp.ClientError, TimeoutError) as error:
        return _Probe(True, None, type(error).__name__)


def is_idle(load: EngineLoad, last_batch_at: float | None, seen_at: float | None) -> bool:
    """Whether the engine is idle: nothing running or waiting in its last `load`, and no
    KV event batch since the one seen at the read before (`seen_at`). An idle engine's
    metrics are read less often (nothing there changes until a request comes, whose
    events end the wait); its /health is still probed every load interval, so that it
    is found down as soon as ever."""
    return load.running == 0 and load.waiting == 0 and last_batch_at == seen_at


def _start_over(reason: str, translator: BlockTranslator, publisher: ControlPlanePublisher) -> None:
    log.warning("the agent's picture of the engine is lost: %s", reason)
    translator.clear()
    publisher.start_new_incarnation(reason)
