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
from collections.abc import Mapping, MutableMapping

from opentelemetry import context, propagate, trace

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
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: name}), sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info(
        "tracing on: service %s, OTLP %s, console %s, sample ratio %g", name, endpoint or "off", console, sample_ratio
    )
    return provider


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def grpc_server_interceptors() -> list:
    """Server spans (rpc.system, rpc.service, rpc.method, status) for every RPC but health."""
    if not isinstance(trace.get_tracer_provider(), _sdk_provider_type()):
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(filter_=_traced_rpcs())]


def grpc_aio_client_interceptors() -> list:
    if not isinstance(trace.get_tracer_provider(), _sdk_provider_type()):
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(filter_=_traced_rpcs())


def _traced_rpcs():
    """Every RPC but health checks and the draft stream, which outlives its rounds: each of
    its messages gets a client and a server span of its own instead."""
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(
        filters.any_of(filters.health_check(), filters.full_method_name("/specserve.v1.DraftService/Draft"))
    )


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Writes the current trace context (traceparent, tracestate) into carrier."""
    propagate.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str]) -> context.Context:
    return propagate.extract(dict(carrier))


def record_span(name: str, start_ns: int, end_ns: int, attributes: Mapping | None = None, parent=None) -> None:
    """A finished span from measured timestamps (work done on another thread, for a batch)."""
    span = tracer().start_span(name, context=parent, start_time=start_ns, attributes=dict(attributes or {}))
    span.end(end_time=end_ns)


def _sdk_provider_type():
    try:
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:  # pragma: no cover - the SDK is a core dependency
        return ()
    return TracerProvider
