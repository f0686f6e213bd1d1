"""The router's tracer: spans only where tracing is configured."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.core.config import TracingSettings
from router.tracing import SPANLESS, open_tracing


def test_without_an_endpoint_the_router_starts_no_span() -> None:
    tracer, provider = open_tracing(TracingSettings())
    assert tracer is SPANLESS
    assert provider is None
    with tracer.start_as_current_span("kvplane.route", attributes={"kvplane.model": "m"}) as span:
        span.set_attribute("kvplane.prompt_tokens", 3)  # accepted, and dropped
        assert not span.is_recording()
        with tracer.start_as_current_span("kvplane.tokenize") as inner:  # nests
            assert not inner.is_recording()


def test_with_an_exporter_spans_are_recorded_with_their_attributes() -> None:
    exporter = InMemorySpanExporter()
    tracer, provider = open_tracing(TracingSettings(), exporter)
    assert provider is not None
    with tracer.start_as_current_span("kvplane.route", attributes={"kvplane.model": "m"}) as span:
        assert span.is_recording()
        span.set_attribute("kvplane.prompt_tokens", 3)
    provider.shutdown()
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "kvplane.route"
    assert finished.attributes == {"kvplane.model": "m", "kvplane.prompt_tokens": 3}
