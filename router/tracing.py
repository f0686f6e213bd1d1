"""OpenTelemetry for the router: one tracer provider per router instance.

Spans: `kvplane.route` per request, with `kvplane.tokenize`, `kvplane.key`,
`kvplane.lookup`, `kvplane.score` and one `kvplane.upstream` per attempt (its time to
first byte as an attribute). Attributes hold ids, counts and times; never prompt or
completion text. Without an OTLP endpoint (and no exporter passed in, as tests do)
the tracer is a no-op and costs next to nothing.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from kvplane.core.config import TracingSettings

_INSTRUMENTATION = "kvplane.router"


def open_tracing(
    settings: TracingSettings, exporter: SpanExporter | None = None
) -> tuple[trace.Tracer, TracerProvider | None]:
    """The router's tracer and the provider to shut down at exit (None: no-op)."""
    if exporter is None and settings.otlp_endpoint is None:
        return trace.NoOpTracer(), None
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBasedTraceIdRatio(settings.sample_ratio),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if settings.otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint))
        )
    return provider.get_tracer(_INSTRUMENTATION), provider
