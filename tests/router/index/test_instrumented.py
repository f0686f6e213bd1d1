"""InstrumentedIndex over a real in-memory index: what it records, and that it changes
nothing of what the backend answers or raises (the conformance suite runs over it too,
as the `instrumented-memory` backend)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvplane.core.config import TracingSettings
from kvplane.core.types import AllBlocksCleared, BlocksRemoved, Tier
from router.index.base import (
    IndexTimeout,
    PrefixMatch,
    StaleIncarnation,
    UnknownWorker,
    index_deadline,
)
from router.index.instrumented import InstrumentedIndex
from router.index.memory import MemoryLocationIndex
from router.index.redis import RedisLocationIndex
from router.metrics import RouterMetrics
from router.tracing import open_tracing
from tests.router.index.test_conformance import LEASE, chain, info, stored


class StuckLookups(MemoryLocationIndex):
    """A memory index whose lookups hang, or hit a bug, while told to."""

    def __init__(self) -> None:
        super().__init__()
        self.bug: Exception | None = None
        self.hanging = False

    async def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        if self.bug is not None:
            raise self.bug
        if self.hanging:
            await asyncio.sleep(10)
        return await super().lookup(keys)


def instrumented(backend: MemoryLocationIndex) -> tuple[InstrumentedIndex, RouterMetrics]:
    metrics = RouterMetrics()
    tracer, _ = open_tracing(TracingSettings())  # no exporter: a no-op tracer
    return InstrumentedIndex(backend, metrics, tracer), metrics


def errors(metrics: RouterMetrics, operation: str, error: str) -> float | None:
    labels = {"operation": operation, "error": error}
    return metrics.registry.get_sample_value("kvplane_index_errors_total", labels)


async def test_applies_lookups_and_refusals_are_recorded() -> None:
    index, metrics = instrumented(MemoryLocationIndex())
    prompt = chain(1, 4)
    await index.register(info("a"), LEASE)
    await index.apply(
        "a",
        1,
        [
            stored(prompt[:3]),
            stored(chain(2, 2)),
            BlocksRemoved([prompt[2]], Tier.DEVICE),
            AllBlocksCleared(),
        ],
    )
    await index.apply("a", 1, [stored(prompt)])
    assert (await index.lookup(prompt))["a"].blocks == 4
    with pytest.raises(StaleIncarnation):
        await index.apply("a", 0, [stored(prompt)])
    with pytest.raises(UnknownWorker):
        await index.renew("b", 1, LEASE)

    value = metrics.registry.get_sample_value
    assert value("kvplane_batches_applied_total") == 2
    assert value("kvplane_events_applied_total", {"kind": "stored"}) == 3
    assert value("kvplane_events_applied_total", {"kind": "removed"}) == 1
    assert value("kvplane_events_applied_total", {"kind": "cleared"}) == 1
    assert value("kvplane_blocks_applied_total", {"kind": "stored"}) == 3 + 2 + 4
    assert value("kvplane_blocks_applied_total", {"kind": "removed"}) == 1
    assert value("kvplane_apply_seconds_count") == 2  # the refused batch is an error only
    assert value("kvplane_lookup_seconds_count") == 1
    assert errors(metrics, "apply", "StaleIncarnation") == 1
    assert errors(metrics, "renew", "UnknownWorker") == 1
    assert errors(metrics, "lookup", "StaleIncarnation") is None


@pytest.mark.parametrize("bug", [TypeError("a bug"), KeyError("w1")], ids=["TypeError", "KeyError"])
async def test_a_bug_in_the_backend_is_counted_and_raised_unchanged(bug: Exception) -> None:
    backend = StuckLookups()
    index, metrics = instrumented(backend)
    backend.bug = bug
    with pytest.raises(type(bug)) as raised:
        await index.lookup(chain(2, 2))
    assert raised.value is bug
    assert errors(metrics, "lookup", type(bug).__name__) == 1
    assert metrics.registry.get_sample_value("kvplane_lookup_seconds_count") == 0


async def test_a_lookup_past_the_callers_deadline_counts_as_cancelled() -> None:
    backend = StuckLookups()
    index, metrics = instrumented(backend)
    backend.hanging = True
    with pytest.raises(IndexTimeout):
        async with index_deadline(0.05):
            await index.lookup(chain(3, 2))
    assert errors(metrics, "lookup", "CancelledError") == 1


def test_only_lookups_that_await_nothing_are_said_to_never_wait() -> None:
    """The planner sets no deadline around such a lookup. The memory index's own await
    nothing; a subclass's may (StuckLookups sleeps), and Redis' are round trips."""
    assert MemoryLocationIndex().lookup_never_waits
    assert instrumented(MemoryLocationIndex())[0].lookup_never_waits
    assert not StuckLookups().lookup_never_waits
    assert not instrumented(StuckLookups())[0].lookup_never_waits
    assert not RedisLocationIndex.lookup_never_waits


async def test_calls_inside_a_traced_request_get_child_spans() -> None:
    exporter = InMemorySpanExporter()
    tracer, provider = open_tracing(TracingSettings(), exporter)
    assert provider is not None
    index = InstrumentedIndex(MemoryLocationIndex(), RouterMetrics(), tracer)
    prompt = chain(4, 4)
    await index.register(info("a"), LEASE)  # no request around it: no span
    await index.apply("a", 1, [stored(prompt)])
    with tracer.start_as_current_span("kvplane.route"):
        await index.lookup(prompt)
        with pytest.raises(StaleIncarnation):
            await index.apply("a", 0, [stored(prompt)])
    provider.shutdown()

    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"kvplane.route", "kvplane.lookup", "kvplane.apply"}
    route, lookup, apply = spans["kvplane.route"], spans["kvplane.lookup"], spans["kvplane.apply"]
    assert route.context is not None
    assert lookup.parent is not None
    assert lookup.parent.span_id == route.context.span_id
    assert lookup.attributes == {"kvplane.blocks": 4}
    assert apply.status.status_code is StatusCode.ERROR
    assert apply.attributes is not None
    assert apply.attributes["kvplane.worker"] == "a"
