"""The agent's proof of its own wiring: the judgement (pure, on a hand-driven clock),
the silence rule over the engine's counters, and what the event source sees over real
ZMQ sockets (a publisher that binds, nothing that binds, a replay nobody answers)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvplane.core.serving import cancel_task, free_port
from kvplane.core.types import EventsState, ReplayState, WiringReport
from tests.waiting import wait_until
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import PrefixCacheCounters
from worker_agent.kv_event_source import KvEventSource
from worker_agent.wiring import SilenceFacts, SourceFacts, WiringWatch, assess

ENDPOINT = "tcp://127.0.0.1:5557"
REPLAY = "tcp://127.0.0.1:5558"
SUBSCRIBED = 100.0
FACTS = SourceFacts(
    endpoint=ENDPOINT,
    replay_endpoint=REPLAY,
    subscribed=True,
    unconnected_since=None,
    last_batch_at=None,
    replay_answered=True,
    replay_timeout_s=2.0,
)
QUIET = SilenceFacts(cached_since=None)


def judged(
    facts: SourceFacts, silence: SilenceFacts = QUIET, now: float = SUBSCRIBED + 1
) -> WiringReport:
    return assess(
        facts, silence, engine_block_size=16, connect_grace_s=3.0, silent_after_s=10.0, now=now
    )


def test_an_event_socket_nobody_binds_is_reported_after_the_grace_with_the_fix() -> None:
    lonely = dataclasses.replace(FACTS, unconnected_since=SUBSCRIBED)
    assert judged(lonely, now=SUBSCRIBED + 2.9).events is EventsState.UNKNOWN
    report = judged(lonely, now=SUBSCRIBED + 3.0)
    assert report.events is EventsState.NOT_CONNECTED
    assert ENDPOINT in report.events_detail
    assert '"endpoint": "tcp://*:5557"' in report.events_detail


def test_an_ipc_endpoint_gets_a_hint_without_a_port() -> None:
    lonely = dataclasses.replace(FACTS, unconnected_since=SUBSCRIBED, endpoint="ipc:///tmp/kv")
    report = judged(lonely, now=SUBSCRIBED + 5)
    assert report.events is EventsState.NOT_CONNECTED
    assert "ipc:///tmp/kv" in report.events_detail
    assert "tcp://*" not in report.events_detail


def test_connected_without_events_is_never_seen_then_flowing() -> None:
    assert judged(FACTS).events is EventsState.NEVER_SEEN
    flowing = judged(dataclasses.replace(FACTS, last_batch_at=SUBSCRIBED + 0.5))
    assert flowing.events is EventsState.FLOWING
    assert flowing.events_detail == ""
    assert judged(dataclasses.replace(FACTS, subscribed=False)).events is EventsState.UNKNOWN


def test_a_publisher_that_went_away_gets_the_grace_again() -> None:
    # Connected for a long while, then the engine restarted: not reported at once.
    gone = dataclasses.replace(FACTS, unconnected_since=SUBSCRIBED + 500)
    assert judged(gone, now=SUBSCRIBED + 502).events is EventsState.UNKNOWN
    assert judged(gone, now=SUBSCRIBED + 503).events is EventsState.NOT_CONNECTED


def test_the_replay_endpoint_is_reported_by_its_last_answer() -> None:
    assert judged(FACTS).replay is ReplayState.OK
    assert judged(dataclasses.replace(FACTS, replay_answered=None)).replay is ReplayState.UNKNOWN
    absent = judged(dataclasses.replace(FACTS, replay_endpoint=None))
    assert absent.replay is ReplayState.NOT_CONFIGURED
    failing = judged(dataclasses.replace(FACTS, replay_answered=False))
    assert failing.replay is ReplayState.FAILING
    assert '"replay_endpoint": "tcp://*:5558"' in failing.replay_detail
    assert "within 2 s" in failing.replay_detail


def test_silence_needs_a_cached_block_and_the_whole_wait() -> None:
    computing = SilenceFacts(cached_since=SUBSCRIBED + 1)
    flowing = dataclasses.replace(FACTS, last_batch_at=SUBSCRIBED)
    assert judged(flowing, computing, now=SUBSCRIBED + 10.9).events is EventsState.FLOWING
    silent = judged(flowing, computing, now=SUBSCRIBED + 11)
    assert silent.events is EventsState.SILENT
    assert "--enable-prefix-caching" in silent.events_detail


def counters(computed: float, prefilled: float) -> PrefixCacheCounters:
    return PrefixCacheCounters(
        queried_tokens=computed + 50, hit_tokens=50, prefilled_requests=prefilled
    )


def watch() -> WiringWatch:
    return WiringWatch(
        connect_grace_s=3.0, silent_after_s=10.0, engine_block_size=16, block_tokens=16
    )


FLOWING = dataclasses.replace(FACTS, last_batch_at=SUBSCRIBED)


def test_an_engine_that_cached_a_block_with_no_event_since_is_silent() -> None:
    agent = watch()
    assert agent.observe(FLOWING, counters(1000, 10), 101).events is EventsState.FLOWING
    # One request prefilled since, 15 tokens computed: maybe no whole block. Then 16.
    assert agent.observe(FLOWING, counters(1015, 11), 102).events is EventsState.FLOWING
    assert agent.observe(FLOWING, counters(1016, 11), 103).events is EventsState.FLOWING
    assert agent.observe(FLOWING, counters(1016, 11), 112.9).events is EventsState.FLOWING
    silent = agent.observe(FLOWING, counters(1016, 11), 113)
    assert silent.events is EventsState.SILENT
    assert "for 10 s" in silent.events_detail
    # An event arrives: the engine is heard again, and the wait starts over.
    heard = dataclasses.replace(FLOWING, last_batch_at=113.5)
    assert agent.observe(heard, counters(1100, 12), 114).events is EventsState.FLOWING
    assert agent.observe(heard, counters(1100, 12), 200).events is EventsState.FLOWING


def test_repeated_prompts_that_compute_a_few_tokens_each_are_never_silent() -> None:
    # A cached 100-token prompt again and again: 4 tokens computed per request, never
    # a whole block, so no event is owed, however many requests add up.
    agent = watch()
    agent.observe(FLOWING, counters(0, 0), 100)
    for second in range(1, 120):
        report = agent.observe(FLOWING, counters(4 * 5 * second, 5 * second), 100 + second)
        assert report.events is EventsState.FLOWING, second


def test_requests_still_in_their_prefill_are_counted_once_they_are_done() -> None:
    # 16 requests in flight, 4 tokens computed each, one prefilled so far: the tokens
    # outrun the count for a moment; once all are prefilled they do not.
    agent = watch()
    agent.observe(FLOWING, counters(0, 0), 100)
    agent.observe(FLOWING, counters(68, 1), 101)
    assert agent.observe(FLOWING, counters(68, 17), 102).events is EventsState.FLOWING
    assert agent.observe(FLOWING, counters(68, 17), 130).events is EventsState.FLOWING


def test_a_quiet_or_restarted_engine_is_never_silent() -> None:
    agent = watch()
    agent.observe(FLOWING, counters(1000, 10), 101)
    assert agent.observe(FLOWING, counters(1000, 10), 500).events is EventsState.FLOWING
    agent.observe(FLOWING, counters(10, 1), 501)  # counters from 0 again: a new baseline
    assert agent.observe(FLOWING, counters(20, 1), 600).events is EventsState.FLOWING
    assert agent.observe(FLOWING, None, 700).events is EventsState.FLOWING  # no counters: no rule


def test_a_problem_is_logged_when_it_starts_and_then_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = watch()
    lonely = dataclasses.replace(FACTS, unconnected_since=SUBSCRIBED)
    with caplog.at_level(logging.INFO, logger="worker_agent.wiring"):
        for now in (SUBSCRIBED + 3, SUBSCRIBED + 4, SUBSCRIBED + 62, SUBSCRIBED + 63.5):
            agent.observe(lonely, None, now)
        agent.observe(FACTS, None, SUBSCRIBED + 64)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # at +3 and +63.5
    assert all("not_connected" in r.getMessage() for r in warnings)
    assert caplog.records[-1].levelno == logging.INFO  # and when it is over


def test_the_adapters_read_their_engines_prefix_counters() -> None:
    ttft = 'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0\n'
    vllm = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0\n'
    ) + ttft
    read = VllmAdapter().parse_prefix_cache(vllm)
    assert read == PrefixCacheCounters(350, 100, 7)
    assert read is not None
    assert read.computed_tokens == 250
    old = "vllm:gpu_prefix_cache_queries_total 8.0\nvllm:gpu_prefix_cache_hits_total 2.0\n" + ttft
    assert VllmAdapter().parse_prefix_cache(old) == PrefixCacheCounters(8, 2, 7)
    sglang = (
        'sglang:prompt_tokens_total{model_name="m"} 4096.0\n'
        'sglang:cached_tokens_total{cache_source="device",model_name="m"} 3000.0\n'
        'sglang:cached_tokens_total{cache_source="host",model_name="m"} 168.0\n'
        'sglang:time_to_first_token_seconds_count{model_name="m"} 12.0\n'
    )
    assert SglangAdapter().parse_prefix_cache(sglang) == PrefixCacheCounters(4096, 3168, 12)
    assert VllmAdapter().parse_prefix_cache("vllm:num_requests_running 1.0\n") is None
    assert VllmAdapter().parse_prefix_cache(vllm.replace(ttft, "")) is None  # no count: no rule


@contextlib.asynccontextmanager
async def sourcing(endpoint: str, replay: str | None) -> AsyncIterator[KvEventSource]:
    source = KvEventSource(VllmAdapter(), endpoint, replay_endpoint=replay, replay_timeout_s=0.2)

    async def pump() -> None:
        async for _ in source.items():
            pass

    task = asyncio.create_task(pump())
    try:
        yield source
    finally:
        await cancel_task(task)
        source.close()


async def test_the_source_sees_a_publisher_that_binds_and_one_that_goes() -> None:
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind("tcp://127.0.0.1:*")
    endpoint = publisher.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        async with sourcing(endpoint, None) as source:
            await wait_until(
                "a connection",
                lambda: source.subscribed_at is not None and source.unconnected_since is None,
            )
            publisher.close(linger=0)
            await wait_until("a disconnection", lambda: source.unconnected_since is not None)
    finally:
        context.destroy(linger=0)


async def test_the_source_sees_that_nothing_binds_and_the_replay_does_not_answer() -> None:
    # As an engine given tcp://127.0.0.1:PORT does: it connects too, and nobody binds.
    context = zmq.asyncio.Context()
    engine = context.socket(zmq.PUB)
    events = f"tcp://127.0.0.1:{free_port()}"
    engine.connect(events)
    try:
        async with sourcing(events, f"tcp://127.0.0.1:{free_port()}") as source:
            await wait_until("a replay", lambda: source.replay_answered is not None)
            assert source.replay_answered is False
            await asyncio.sleep(0.5)
            assert source.unconnected_since == source.subscribed_at
            assert source.last_batch_at is None
    finally:
        context.destroy(linger=0)
