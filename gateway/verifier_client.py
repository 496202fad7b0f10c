"""The verifier client of one request's session: its calls (Prefill, Verify, a Decode stream,
Release) on the replica that holds the session, traced, with the retries and moves that
keep a request going while a verifier restarts or leaves (docs/design.md, "Failures").
session is the request's generation._Session: its id, route, sequence and sampling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from gateway.clients import Backends
from gateway.replicas import NoReplica
from gateway.rounds import decoded_round
from specserve.serving.telemetry import (
    metadata_with_trace_context,
    rpc_span,
    set_rpc_status,
    start_span,
    tracing_enabled,
)
from specserve.v1 import verify_pb2

log = logging.getLogger("gateway.generation")

VERIFY_SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # the verifier may be restarting


async def prefill(session, prompt_logprobs: int | None = None, copy_of: str = "") -> verify_pb2.PrefillResponse:
    """The session's sequence prefilled on its verifier replica: the next token (its logprob
    where the sampling asks), and the prompt's logprobs with prompt_logprobs top ones, asked;
    copy_of: a session of the same prompt whose cache the verifier may copy."""
    request = verify_pb2.PrefillRequest(
        session_id=session.id,
        token_ids=session.sequence,
        sampling=session.sampling,
        prompt_logprobs=prompt_logprobs is not None,
        prompt_top_logprobs=prompt_logprobs or 0,
        copy_of=copy_of,
        prompt_length=len(session.plan.prompt_token_ids),
        grammar=session.plan.grammar.to_proto() if session.plan.grammar is not None else None,
    )
    return await call_verifier(session, "Prefill", request)


RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # the verifier may be restarting


async def call_verifier(session, method: str, request):
    """A call to the session's verifier replica. One that is unreachable moves the session
    to another replica that is up (where its Verify is refused as out of step, which
    prefills it again); with none, the call is retried while the verifier restarts, up to
    verify_retry_s. Safe for both calls: Prefill replaces its session, and a Verify whose
    first attempt did land is refused as out of step, which prefills again."""
    backends = session.backends
    deadline = time.monotonic() + backends.deadlines.verify_retry_s
    pause = 0.1
    while True:
        try:
            replica = session.route.current()
            return await traced_call(
                replica.stub,
                method,
                request,
                timeout=backends.rpc_timeout_s,
                wait_for_ready=len(backends.verifiers) == 1,
            )
        except (grpc.aio.AioRpcError, NoReplica) as error:
            code = status_code(session, error)
            if code not in RETRIED or time.monotonic() + pause > deadline:
                raise
            if move(session):
                continue  # at once, on a replica that is up
            log.warning("verifier unavailable (%s); retrying", describe(error))
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


def status_code(session, error: BaseException) -> grpc.StatusCode:
    """A failed verifier call's status as the retries read it: no replica known is
    UNAVAILABLE, a timeout DEADLINE_EXCEEDED, and a call cancelled because its replica left
    the name (its channel closed) UNAVAILABLE."""
    if isinstance(error, NoReplica):
        return grpc.StatusCode.UNAVAILABLE
    if not isinstance(error, grpc.aio.AioRpcError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    replica = session.route.replica
    if error.code() == grpc.StatusCode.CANCELLED and replica is not None and replica.gone:
        return grpc.StatusCode.UNAVAILABLE
    return error.code()


def move(session) -> bool:
    """Moves a session off its unreachable replica to one that is up, where there is one;
    the replica it left may still hold its cache, which a release of its own (detached)
    frees. Whether it moved."""
    backends = session.backends
    if len(backends.verifiers) < 2:
        return False
    left = session.route.failed()
    if left is None:
        return False
    if not left.gone:
        detach(backends, release_on(left, session.id))
    return True


async def verify(
    session, drafts: list[int], distributions: list, parents: list[int] | None = None
) -> tuple[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse | None]:
    """The request and the verifier's answer, None when it no longer holds the session as we
    do. parents: a token tree's (None: the drafts are a chain)."""
    request = verify_pb2.VerifyRequest(
        session_id=session.id,
        num_verified=len(session.sequence),
        draft_token_ids=drafts,
        draft_distributions=distributions,
        sampling=session.sampling,
        draft_parents=parents or (),
    )
    try:
        return request, await call_verifier(session, "Verify", request)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        log.warning("verifier session out of step (%s); prefilling again", error.details())
        return request, None


async def decode(session, request: verify_pb2.DecodeRequest, parent: Context | None):
    """The Decode stream's tokens as rounds, under one client span when tracing is on (not
    made current: the consumer runs between tokens). A round's verify time is the gap since
    the previous token arrived (the call's start, for the first), matching the service's
    server_seconds. Each token must arrive within rpc_timeout_s of the one before
    (TimeoutError otherwise); the call is cancelled when the consumer stops early, which is
    no error."""
    call_span = start_span(
        f"{VERIFY_SERVICE}/Decode", kind=SpanKind.CLIENT, context=parent, attributes=_DECODE_ATTRIBUTES
    )
    call, status, made = None, grpc.StatusCode.OK, 0
    try:
        last = time.perf_counter()
        backends = session.backends
        stub = session.route.current().stub
        call = stub.Decode(
            request, metadata=metadata_with_trace_context(call_span), wait_for_ready=len(backends.verifiers) == 1
        )
        wire_bytes = request.ByteSize()  # counted with the first round
        while (response := await asyncio.wait_for(call.read(), backends.rpc_timeout_s)) is not grpc.aio.EOF:
            now = time.perf_counter()
            round_ = decoded_round(response, now - last, wire_bytes + response.ByteSize())
            made += len(round_.new_tokens)
            yield round_
            last, wire_bytes = now, 0
    except grpc.aio.AioRpcError as error:
        status = error.code()
        raise
    except (TimeoutError, asyncio.CancelledError):
        status = grpc.StatusCode.CANCELLED
        raise
    finally:  # GeneratorExit (the consumer has what it wanted) ends the span as OK
        if call is not None:
            await _end(call, status == grpc.StatusCode.OK and made >= request.max_tokens)
        if call_span.is_recording():
            set_rpc_status(call_span, status)
            call_span.end()


async def _end(call, made_all: bool) -> None:
    """Ends a Decode call whose consumer stopped: a stream that made every token asked for
    ends by itself right after its last one, so it is let end (OK on both sides, not a
    cancellation racing the server's status); any other is cancelled (nothing when it has
    finished)."""
    try:
        if made_all and not call.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(call.code(), 1.0)
    finally:
        call.cancel()


_DECODE_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": VERIFY_SERVICE, "rpc.method": "Decode"}


async def traced_call(stub, method: str, request, **options):
    """A unary verifier call with a client span (when tracing is on) whose trace context
    travels in the call's metadata."""
    call = getattr(stub, method)
    if not tracing_enabled():
        return await call(request, **options)
    with rpc_span(SpanKind.CLIENT, f"/{VERIFY_SERVICE}/{method}") as span:
        try:
            response = await call(request, metadata=metadata_with_trace_context(), **options)
        except grpc.aio.AioRpcError as error:
            set_rpc_status(span, error.code())
            raise
        set_rpc_status(span, grpc.StatusCode.OK)
        return response


async def release(session) -> None:
    """Frees the session on its replica (none was picked, or it left: nothing to free)."""
    if session.route.replica is not None and not session.route.replica.gone:
        await release_on(session.route.replica, session.id)


async def release_on(replica, session_id: str) -> None:
    request = verify_pb2.ReleaseRequest(session_id=session_id)
    try:
        await traced_call(replica.stub, "Release", request, timeout=5)
    except Exception as error:  # noqa: BLE001 - a release that fails leaves the session to the TTL, never fails a request
        log.warning("release of session %s on %s failed: %s", session_id, replica.address, describe(error))


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def detach(backends: Backends, work) -> asyncio.Task:
    """work as a task of its own, out of reach of the request's cancellation, held in
    backends.detached until it is done."""
    task = asyncio.ensure_future(work)
    backends.detached.add(task)
    task.add_done_callback(backends.detached.discard)
    return task
