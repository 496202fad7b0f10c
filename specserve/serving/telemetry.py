"""OpenTelemetry tracing for every process: one trace per HTTP request across gateway,
draft and verifier, with W3C trace context in gRPC metadata (and, for the per-round messages
of a draft stream, in the message itself).

Nothing is exported by default, and then no SDK is installed at all: the API's no-op tracer
costs nothing. OTEL_EXPORTER_OTLP_ENDPOINT turns on OTLP over gRPC, --trace-console prints
spans, OTEL_SERVICE_NAME renames the process, --trace-sample-ratio samples whole traces.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache

from opentelemetry import context, propagate, trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

TRACER_NAME = "specserve"


def setup_tracing(default_service_name: str, console: bool, sample_ratio: float):
    """Installs a tracer provider when some exporter is asked for; returns it (or None)."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and not console:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    # OTEL_TRACES_SAMPLER (and its _ARG), where set, is the SDK's to read: no sampler is passed.
    sampler = None if os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}), sampler=sampler)
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info(
        "tracing on: service %s, OTLP %s, console %s, sampler %s",
        name,
        endpoint or "off",
        console,
        os.environ.get("OTEL_TRACES_SAMPLER") or f"ratio {sample_ratio:g}",
    )
    return provider


@cache
def tracer() -> trace.Tracer:
    """The project's tracer, made once (the SDK builds a new one on every get_tracer call).
    Made before setup_tracing it is the API's proxy, which follows the provider set later."""
    return trace.get_tracer(TRACER_NAME)


def tracing_enabled() -> bool:
    """Whether an SDK tracer provider is installed (setup_tracing found an exporter)."""
    return isinstance(trace.get_tracer_provider(), _sdk_provider_type())


def span(name: str, carrier: Mapping[str, str] | None = None, **options) -> AbstractContextManager[Span]:
    """tracer().start_as_current_span(name, **options), the parent taken from carrier's trace
    context when one is given; with tracing off no span at all: even the API's no-op spans,
    their contexts and attribute dicts cost ~2% of tokens/s across a round's dozen of them
    on this project's 2-core machine."""
    if not tracing_enabled():
        return nullcontext(INVALID_SPAN)
    if carrier is not None:
        options["context"] = extract(carrier)
    return tracer().start_as_current_span(name, **options)


def start_span(name: str, **options) -> Span:
    """tracer().start_span(name, **options); with tracing off the invalid span, made for free."""
    return tracer().start_span(name, **options) if tracing_enabled() else INVALID_SPAN


# RPC spans are made here rather than by the generic grpc instrumentation's interceptors:
# those cost a large share of a loopback call on each side, sampled or not, and a round makes
# two calls (docs/benchmarks.md, "Tracing, load and fuzzing").
@contextmanager
def rpc_span(kind: SpanKind, full_method: str, parent: context.Context | None = None) -> Iterator[Span]:
    """The span of one RPC, full_method as "/package.Service/Method": rpc.system, rpc.service,
    rpc.method, and rpc.grpc.status_code (set_rpc_status) when it ends."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    with tracer().start_as_current_span(
        f"{service}/{method}",
        context=parent,
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def set_rpc_status(span: Span, code) -> None:
    """Records a grpc.StatusCode on an RPC span (an error status unless OK)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code.value[0] != 0:
        span.set_status(Status(StatusCode.ERROR, code.name))


def metadata_with_trace_context(span: Span | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the trace context of span (default: the current one)."""
    return tuple(inject({}, span).items())


def inject(carrier: MutableMapping[str, str], span: Span | None = None) -> MutableMapping[str, str]:
    """Writes the trace context (traceparent, tracestate) of span, or the current one, into
    carrier; nothing with tracing off."""
    if tracing_enabled():
        propagate.inject(carrier, context=None if span is None else trace.set_span_in_context(span))
    return carrier


def extract(carrier: Mapping[str, str]) -> context.Context:
    return propagate.extract(dict(carrier))


def record_span(name: str, start_ns: int, end_ns: int, attributes: Mapping | None = None, parent=None) -> None:
    """A finished span from measured timestamps (work done on another thread, for a batch),
    a child of parent or of the current span; nothing when that one is not recorded (tracing
    off, or a trace not sampled: the child would not be recorded either)."""
    parent_span = trace.get_current_span(parent)
    if not parent_span.is_recording():
        return
    child = tracer().start_span(name, context=parent, start_time=start_ns, attributes=dict(attributes or {}))
    child.end(end_time=end_ns)


@cache
def _sdk_provider_type():
    try:
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:  # pragma: no cover - the SDK is a core dependency
        return ()
    return TracerProvider
