"""What both gRPC services share: the error (and tracing) interceptor, health, reflection, serving."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Span, SpanKind

from specserve.errors import FailedPrecondition, InvalidArgument, RequestError, ResourceExhausted
from specserve.serving.telemetry import extract, rpc_span, set_rpc_status, tracing_enabled
from specserve.serving.tls import server_credentials

log = logging.getLogger(__name__)

NUM_VERIFIED_METADATA_KEY = "specserve-num-verified"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def status_of(error: RequestError) -> grpc.StatusCode:
    if isinstance(error, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


def _abort(context: grpc.ServicerContext, error: BaseException, method: str) -> None:
    if isinstance(error, RequestError):
        if isinstance(error, FailedPrecondition):
            context.set_trailing_metadata(((NUM_VERIFIED_METADATA_KEY, str(error.num_verified)),))
        context.abort(status_of(error), str(error))
    log.exception("%s failed", method, exc_info=error)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}")


def _code_of(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, RequestError):
        return status_of(error)
    return grpc.StatusCode.INTERNAL


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps request errors to their status codes in one place; a bug answers INTERNAL and
    the service keeps serving the other requests. With tracing on, each call of the
    service's own API with one request (unary, or answered by a stream) also gets a server
    span, a child of the caller's trace context (the draft stream traces each of its
    messages itself; health and reflection are not traced)."""

    def __init__(self, traced: bool | None = None):
        self._traced = tracing_enabled() if traced is None else traced

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        traced = self._traced and method.startswith("/specserve.")
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _guard_unary(handler.unary_unary, method, traced),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(handler.unary_stream, method, traced),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _guard_stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


@contextmanager
def _server_span(context, method: str, traced: bool) -> Iterator[Span | None]:
    """The call's server span, a child of the caller's trace context; None untraced."""
    if not traced:
        yield None
        return
    with rpc_span(SpanKind.SERVER, method, extract(dict(context.invocation_metadata()))) as span:
        yield span


def _status(span: Span | None, code: grpc.StatusCode) -> None:
    if span is not None:
        set_rpc_status(span, code)


def _guard_unary(behavior: Callable, method: str, traced: bool = False) -> Callable:
    def guarded(request, context):
        with _server_span(context, method, traced) as span:
            try:
                reply = behavior(request, context)
            except Exception as error:  # noqa: BLE001 - mapped to a status, never kills the server
                _status(span, _code_of(error))
                _abort(context, error, method)
            _status(span, grpc.StatusCode.OK)
            return reply

    return guarded


def _guard_stream(behavior: Callable, method: str, traced: bool = False) -> Callable:
    """For calls that answer with a stream (one request or a stream of them in); traced,
    the whole call is one server span."""

    def guarded(request, context) -> Iterator:
        with _server_span(context, method, traced) as span:
            try:
                yield from behavior(request, context)
            except GeneratorExit:  # the client cancelled the call while an answer was on its way
                _status(span, grpc.StatusCode.CANCELLED)
                raise
            except grpc.RpcError:
                if context.is_active():
                    raise
                # The client went away mid-stream: nothing to answer, nothing to log.
            except Exception as error:  # noqa: BLE001
                _status(span, _code_of(error))
                _abort(context, error, method)
            else:
                _status(span, grpc.StatusCode.OK)

    return guarded


# Clients behind a headless Service re-resolve DNS only when a connection ends: closing
# connections after 10 minutes (with 10 more for the streams on them to finish) lets new
# replicas take load. A draft stream that still outlives that costs one target-only round.
# One server per port: with gRPC's default SO_REUSEPORT a second service started on the same
# port would listen beside the first, and calls would land on either.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
SERVER_OPTIONS = [
    EXCLUSIVE_PORT,
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_connection_age_ms", 600_000),
    ("grpc.max_connection_age_grace_ms", 600_000),
]


def make_server(max_workers: int) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[ErrorInterceptor()],
        options=SERVER_OPTIONS,
    )


def start_health_port(servicer: health.HealthServicer, host: str, port: int) -> grpc.Server | None:
    """A plaintext port serving grpc.health.v1 only, for probes that cannot speak (m)TLS
    (the kubelet's native gRPC probe); None when port is 0."""
    if not port:
        return None
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"), options=[EXCLUSIVE_PORT]
    )
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"could not listen on {host}:{port}")
    server.start()
    return server


def add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


def set_serving(servicer: health.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        servicer.set(name, status)


def serve_until_signalled(
    server: grpc.Server,
    servicer: health.HealthServicer,
    service_names: list[str],
    address: str,
    grace_s: float,
    credentials: grpc.ServerCredentials | None = None,
    main_loop: Callable[[], None] | None = None,
    on_stopped: Callable[[], None] | None = None,
    ready: Callable[[], bool] | None = None,
) -> None:
    """Starts the server (TLS only when given credentials), reports SERVING, and runs
    main_loop on this thread (or waits); with ready, SERVING waits until ready() holds. On
    SIGTERM or SIGINT: reports NOT_SERVING, lets
    in-flight calls finish for up to grace_s, stops, then calls on_stopped, which must make
    main_loop return."""
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise SystemExit(f"could not listen on {address}")
    server.start()
    stopped, draining, health_lock = threading.Event(), threading.Event(), threading.Lock()
    if ready is None or ready():
        set_serving(servicer, service_names, True)
        log.info("serving %s on %s", ", ".join(service_names), address)
    else:  # calls are answered meanwhile; health says NOT_SERVING until ready() holds
        set_serving(servicer, service_names, False)
        log.info("serving %s on %s; ready once the drafts' steps are compiled", ", ".join(service_names), address)

        def report_ready() -> None:
            while not draining.is_set() and not ready():
                time.sleep(0.2)
            with health_lock:
                if not draining.is_set():
                    set_serving(servicer, service_names, True)
                    log.info("ready")

        threading.Thread(target=report_ready, name="report-ready", daemon=True).start()

    def shut_down() -> None:
        log.info("shutting down (grace %.0f s)", grace_s)
        with health_lock:
            draining.set()  # a compile that ends now must not report SERVING again
            set_serving(servicer, service_names, False)
        server.stop(grace_s).wait()
        if on_stopped is not None:
            on_stopped()
        stopped.set()

    def on_signal(*_) -> None:
        if not getattr(on_signal, "fired", False):
            on_signal.fired = True
            threading.Thread(target=shut_down, name="shutdown", daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if main_loop is not None:
        main_loop()
    stopped.wait()


def busy_port(config, program: str) -> str | None:
    """One line naming a port of a service's config (its gRPC, metrics or health port) that
    is taken, checked before the model loads; None when all are free."""
    from specserve.ports import first_busy_port

    flags = ((config.port, "--port"), (config.metrics_port, "--metrics-port"), (config.health_port, "--health-port"))
    return first_busy_port(program, [(config.host, port, flag) for port, flag in flags])


def run_service(
    service_name: str, register: Callable[[grpc.Server], None], config, batcher=None, tracing=None, ready=None
) -> None:
    """Builds the server around one servicer (register adds it) as a service config asks
    (address, max_workers, grace_s, TLS files, health_port) and serves until signalled,
    running the batcher's worker (if any) on this, the main, thread; then flushes the spans
    tracing (a tracer provider, if any) still buffers."""
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    server = make_server(config.max_workers)
    register(server)
    servicer = add_health_and_reflection(server, [service_name])
    health_server = start_health_port(servicer, config.address.rsplit(":", 1)[0], config.health_port)
    serve_until_signalled(
        server,
        servicer,
        [service_name],
        config.address,
        config.grace_s,
        credentials,
        main_loop=batcher.run if batcher else None,
        on_stopped=batcher.close if batcher else None,
        ready=ready,
    )
    if health_server is not None:
        health_server.stop(0)
    if tracing is not None:
        tracing.shutdown()
    _exit_if_compiling()


def _exit_if_compiling() -> None:
    """Leaves at once where a draft's steps are still compiling in a thread of their own: a
    compile cannot be stopped, and finalising the interpreter under it aborts the process
    ("terminate called without an active exception")."""
    if any(t.name == "compile-steps" and t.is_alive() for t in threading.enumerate()):
        log.info("stopped while a draft's steps were compiling")
        logging.shutdown()
        os._exit(0)
