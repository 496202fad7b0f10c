"""One request's rounds: prefill, then rounds until the consumer stops asking.

Where the verifier drafts for the request's method itself (colocated drafting), all its
rounds run in one Decode stream with speculation set: the verifier drafts, verifies and
goes on without waiting for the gateway, which gets each round's tokens as they come.
Where the draft service drafts, each round is a Draft call and a Verify call. Target-only
(method "none", a crowded server, or a draft service that is down) is one Decode stream of
tokens.

The gateway owns the canonical sequence (docs/design.md, invariant 3): services hold caches that
can be rebuilt. A draft stream that fails costs a target-only stretch and is reopened with
the whole sequence; a verifier that lost the session (or restarted mid-decode) is
prefilled again from the sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from gateway.backends import Backends, DraftStream
from gateway.replicas import NoReplica, Route
from specserve.logs import RateLimitedLog
from specserve.metrics import GatewayMetrics
from specserve.sampling import SamplingParams
from specserve.speculation import KChooser, Speculation
from specserve.telemetry import (
    inject,
    metadata_with_trace_context,
    rpc_span,
    set_rpc_status,
    span,
    start_span,
    tracing_enabled,
)
from specserve.v1 import draft_pb2, verify_pb2

log = logging.getLogger(__name__)

VERIFY_SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


_draft_failures = RateLimitedLog(log)


@dataclass(frozen=True)
class GenerationPlan:
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    method: str  # draft_model | early_exit | ngram | none
    num_speculative_tokens: int  # K, where an adaptive choice starts
    adaptive: bool = False  # K per round from the session's measured costs (specserve.speculation)
    min_draft_probability: float = 0.0
    k_bounds: tuple[int, int] = (0, 8)  # the adaptive choice's range (0: it may stop drafting)
    pipeline: bool = False  # draft round r + 1 while round r is verified (a draft service's rounds)
    yields_to_load: bool = True  # decodes target-only while crowded() (a seeded sampled request does not)
    local: bool = False  # the verifier drafts for this method itself: all rounds in one Decode stream

    @property
    def speculation(self) -> Speculation | None:
        if self.method == "none":
            return None
        return Speculation(self.method, self.num_speculative_tokens, self.adaptive, self.k_bounds,
                           self.min_draft_probability)  # fmt: skip


@dataclass
class RoundTimings:
    """Where a request's round time went (usage.timings with return_timings): seconds as the
    gateway saw each call, the services' own share of it, and the verifier's batch sizes."""

    rounds: int = 0
    draft_seconds: float = 0.0
    draft_server_seconds: float = 0.0
    verify_seconds: float = 0.0
    verify_server_seconds: float = 0.0
    verify_forward_seconds: float = 0.0
    verify_kernel_seconds: float = 0.0
    wire_bytes: int = 0  # serialized draft and verify messages, both ways
    pipelined_rounds: int = 0  # rounds whose drafts were made while the previous one was verified
    batch_sizes: dict[int, int] = field(default_factory=dict)
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # the K each round verified (0: target-only)
    accepted_per_position: list[int] = field(default_factory=list)  # rounds whose draft i was accepted

    def as_dict(self) -> dict:
        wire = (self.draft_seconds - self.draft_server_seconds) + (self.verify_seconds - self.verify_server_seconds)
        histograms = ("batch_sizes", "rounds_by_k")
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in histograms}
        values.update({name: {str(k): v for k, v in sorted(getattr(self, name).items())} for name in histograms})
        return {**values, "wire_seconds": wire}


@dataclass
class SpeculationStats:
    """usage.speculation of a response: rounds with drafts, drafts sent, drafts kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    timings: RoundTimings = field(default_factory=RoundTimings)

    def as_dict(self) -> dict[str, int]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }


@dataclass(frozen=True)
class Round:
    """One round as the gateway saw it. A round drafted in the verifier (colocated) has no
    draft call: its draft seconds are the verifier's drafting, as seen and as spent."""

    new_tokens: list[int]
    k: int  # draft tokens verified (0: a target-only round)
    num_accepted: int
    batch_size: int
    draft_seconds: float
    draft_server_seconds: float
    verify_seconds: float
    verify_server_seconds: float
    verify_forward_seconds: float = 0.0
    verify_kernel_seconds: float = 0.0
    wire_bytes: int = 0
    pipelined: bool = False  # drafted during the previous round's verification

    @property
    def wire_seconds(self) -> float:
        return (self.draft_seconds - self.draft_server_seconds) + (self.verify_seconds - self.verify_server_seconds)

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds


# Target-only stretches of a speculative request (a draft service that failed, or too many
# requests for speculation to pay) decode this many tokens before drafting is tried again,
# twice as many after each stretch in a row (up to the maximum): every new Decode call waits
# for a batch to join, which cost ~8% of tokens/s at 16-token stretches (4 and 16 clients).
TARGET_ONLY_STRETCH = (16, 256)


async def generate(
    backends: Backends,
    plan: GenerationPlan,
    stats: SpeculationStats,
    parent: Context | None = None,
    metrics: GatewayMetrics | None = None,
    crowded: Callable[[], bool] | None = None,
) -> AsyncIterator[list[int]]:
    """Yields each round's new verified tokens; closing the iterator ends both sessions.
    Spans (prefill, one per round) are children of parent; each round feeds metrics.
    Target-only requests decode in one Decode stream; a speculative one decodes target-only
    stretches while its draft service is unavailable or, where the plan yields to load,
    crowded() says too many requests run."""
    if not plan.yields_to_load:
        crowded = None
    session = _Session(backends, plan, uuid.uuid4().hex)
    try:
        with span("prefill", context=parent):
            first = await _prefill(session)
        session.sequence.append(first)
        yield [first]
        generated = 1
        while generated < plan.max_tokens:
            remaining = plan.max_tokens - generated
            stretch = session.next_stretch(remaining, busy=crowded is not None and crowded())
            if stretch is not None:  # a Decode stream: the verifier's own rounds, or target-only
                speculation, wanted = stretch
                made = 0
                async with aclosing(session.decode(wanted, parent, speculation)) as rounds:
                    async for round_ in rounds:
                        _account(round_, stats, metrics)
                        made += len(round_.new_tokens)
                        yield round_.new_tokens
                generated += made
                if made < wanted:  # the stream ended early: an end-of-sequence token
                    return
                continue
            with span("round", context=parent) as round_span:
                round_ = await session.round(session.k, remaining=remaining)
                if round_span.is_recording():
                    round_span.set_attributes(_round_attributes(round_))
            _account(round_, stats, metrics)
            session.observe(round_)
            session.sequence.extend(round_.new_tokens)
            generated += len(round_.new_tokens)
            yield round_.new_tokens
    finally:
        await _close_detached(backends, session)


async def _close_detached(backends: Backends, session: _Session) -> None:
    """Closes both sessions even when the request is being cancelled (its client went away):
    the release runs as a task of its own, which the cancellation does not reach, held in
    backends.detached until it is done."""
    await asyncio.shield(_detach(backends, session.close()))


def _detach(backends: Backends, work) -> asyncio.Task:
    """work as a task of its own, out of reach of the request's cancellation, held in
    backends.detached until it is done."""
    task = asyncio.ensure_future(work)
    backends.detached.add(task)
    task.add_done_callback(backends.detached.discard)
    return task


class _Session:
    """One request's state across rounds: its sequence, its draft stream and K choice (for a
    draft service's rounds), and the proposal drafted ahead for the next round when
    pipelining."""

    def __init__(self, backends: Backends, plan: GenerationPlan, session_id: str):
        self.backends = backends
        self.plan = plan
        self.id = session_id
        self.sampling = plan.sampling.to_proto()
        self.sequence = list(plan.prompt_token_ids)
        self.route = Route(backends.verifiers, session_id)  # the verifier replica that holds it
        remote = plan.method != "none" and not plan.local
        self.drafter = DraftStream(backends, session_id, plan.method, plan.min_draft_probability) if remote else None
        self.chooser = KChooser(plan.speculation, backends.shared) if remote else None
        self.drafted_rounds = 0
        self.last_k = 0  # the K of the round before
        self.k = 0  # the next remote round's K
        self.stretch = TARGET_ONLY_STRETCH[0]
        self.prefetched: draft_pb2.DraftResponse | None = None

    def next_stretch(self, remaining: int, busy: bool) -> tuple[Speculation | None, int] | None:
        """How the next tokens are made: (speculation, tokens) for a Decode stream, the
        verifier's own rounds or (speculation None) target-only tokens; None for a round
        drafted by the draft service, of self.k drafts. busy: too many requests run for
        speculation to pay."""
        plan = self.plan
        if plan.method == "none":
            return None, remaining
        if not busy and plan.local:
            return plan.speculation, remaining
        if busy or not self.drafter.available:
            self.prefetched = None  # drafted for a sequence these tokens replace
            wanted, self.stretch = min(self.stretch, remaining), min(2 * self.stretch, TARGET_ONLY_STRETCH[1])
            return None, wanted
        self.stretch = TARGET_ONLY_STRETCH[0]
        self.k = self.chooser.next_k(remaining)
        if self.k == 0:  # drafts do not pay now: target-only tokens until the chooser tries again
            self.prefetched = None
            return None, min(remaining, max(1, self.chooser.target_only_tokens))
        return None

    def observe(self, round_: Round) -> None:
        """Feeds a round of a draft service's (or a target-only token of such a request) to the
        K chooser."""
        if self.chooser is not None:
            verify = round_.verify_forward_seconds + round_.verify_kernel_seconds
            # The first drafting reads the prompt, the first after target-only rounds what they
            # made: no round's usual cost (verify_service.local_drafts.SessionDrafts.observe).
            usual = self.drafted_rounds and self.last_k > 0
            draft = round_.draft_server_seconds if usual else None
            self.drafted_rounds += round_.k > 0
            self.last_k = round_.k
            self.chooser.observe(round_.k, round_.num_accepted, draft, verify, round_.seconds)

    async def decode(
        self, remaining: int, parent: Context | None, speculation: Speculation | None = None
    ) -> AsyncIterator[Round]:
        """Rounds from Decode streams, the verifier's own (speculation set) or target-only
        tokens: one stream for all of them unless the verifier loses the session, which is
        prefilled again (one token) and decoding goes on. Each round's tokens join the
        sequence before it is yielded."""
        while remaining > 0:
            request = verify_pb2.DecodeRequest(
                session_id=self.id, num_verified=len(self.sequence), max_tokens=remaining, sampling=self.sampling,
                speculation=speculation.to_proto() if speculation is not None else None,
            )  # fmt: skip
            try:
                async with aclosing(_decode(self, request, parent)) as rounds:
                    async for round_ in rounds:
                        self.sequence.extend(round_.new_tokens)
                        remaining -= len(round_.new_tokens)
                        if speculation is None:
                            self.observe(round_)
                        yield round_
                return  # the stream ended: all made, an end-of-sequence token, or the context is full
            except (grpc.aio.AioRpcError, TimeoutError, NoReplica) as error:
                code = _code(self, error)
                if code not in (grpc.StatusCode.FAILED_PRECONDITION, *_RETRIED):
                    raise
                log.warning("decode stream broken (%s); prefilling again", _describe(error))
                if code in _RETRIED:
                    _move(self)  # another replica prefills it, where one is up
            started = time.perf_counter()
            with span("prefill", context=parent):
                token = await _prefill(self)
            self.sequence.append(token)
            remaining -= 1
            yield Round(new_tokens=[token], k=0, num_accepted=0, batch_size=1, draft_seconds=0.0,
                        draft_server_seconds=0.0, verify_seconds=time.perf_counter() - started,
                        verify_server_seconds=0.0)  # fmt: skip

    async def round(self, k: int, remaining: int) -> Round:
        drafts, distributions, guess, draft_s, draft_server_s, draft_bytes = await self._drafts(k)
        started = time.perf_counter()
        verify = asyncio.ensure_future(_verify(self, drafts, distributions))
        ahead = self._draft_ahead(drafts, guess, remaining)
        request, response = await verify
        verify_s = time.perf_counter() - started
        await self._settle(ahead, drafts, guess, response)
        if response is None:  # the verifier lost the session: prefilled again, one token
            new = [await _prefill(self)]
            return Round(new_tokens=new, k=0, num_accepted=0, batch_size=1, draft_seconds=draft_s,
                         draft_server_seconds=draft_server_s, verify_seconds=time.perf_counter() - started,
                         verify_server_seconds=0.0)  # fmt: skip
        new = [*drafts[: response.num_accepted], response.next_token_id]
        wire_bytes = draft_bytes + request.ByteSize() + response.ByteSize()
        return Round(new_tokens=new, k=len(drafts), num_accepted=response.num_accepted,
                     batch_size=response.batch_size, draft_seconds=draft_s, draft_server_seconds=draft_server_s,
                     verify_seconds=verify_s, verify_server_seconds=response.server_seconds,
                     verify_forward_seconds=response.forward_seconds, verify_kernel_seconds=response.kernel_seconds,
                     wire_bytes=wire_bytes, pipelined=draft_s == 0 and bool(drafts))  # fmt: skip

    async def _drafts(self, k: int):
        """(drafts, distributions, bonus guess, seconds, service seconds, bytes): the proposal
        drafted ahead during the last round if it still applies, else a fresh one."""
        if self.prefetched is not None and k > 0:
            ahead, self.prefetched = self.prefetched, None
            drafts = list(ahead.draft_token_ids[:k])
            guess = ahead.bonus_guess if len(drafts) == len(ahead.draft_token_ids) else -1
            return drafts, list(ahead.draft_distributions[:k]), guess, 0.0, 0.0, ahead.ByteSize()
        self.prefetched = None
        if k == 0:
            return [], [], -1, 0.0, 0.0, 0
        drafts, distributions, guess, seconds, server, wire, _ = await _draft(
            self.drafter, self.sequence, k, self.sampling, self.plan.pipeline
        )
        return drafts, distributions, guess, seconds, server, wire

    def _draft_ahead(self, drafts: list[int], guess: int, remaining: int):
        """While the verifier checks this round, draft the next one as if every draft and the
        draft's own bonus guess were accepted."""
        if not (self.plan.pipeline and drafts and guess >= 0):
            return None
        k_next = min(
            self.chooser.k_after_all_kept(len(drafts), remaining - len(drafts) - 1), remaining - len(drafts) - 2
        )
        if k_next < 1:
            return None
        guessed = [*drafts, guess]
        return asyncio.ensure_future(_draft(self.drafter, self.sequence, k_next, self.sampling, True, guessed))

    async def _settle(self, ahead, drafts: list[int], guess: int, response) -> None:
        if ahead is None:
            return
        proposal = await ahead
        held = response is not None and response.num_accepted == len(drafts) and response.next_token_id == guess
        if held and proposal[0]:
            self.drafter.confirm(len(self.sequence) + len(drafts) + 1)
            self.prefetched = proposal[-1]

    async def close(self) -> None:
        if self.drafter is not None:
            await self.drafter.close()
        await _release(self)


def _round_attributes(round_: Round) -> dict:
    return {
        "specserve.k": round_.k,
        "specserve.num_accepted": round_.num_accepted,
        "specserve.batch_size": round_.batch_size,
        "specserve.draft_seconds": round_.draft_seconds,
        "specserve.verify_seconds": round_.verify_seconds,
        "specserve.wire_seconds": round_.wire_seconds,
    }


def _account(round_: Round, stats: SpeculationStats, metrics: GatewayMetrics | None) -> None:
    timings = stats.timings
    timings.rounds += 1
    timings.draft_seconds += round_.draft_seconds
    timings.draft_server_seconds += round_.draft_server_seconds
    timings.verify_seconds += round_.verify_seconds
    timings.verify_server_seconds += round_.verify_server_seconds
    timings.verify_forward_seconds += round_.verify_forward_seconds
    timings.verify_kernel_seconds += round_.verify_kernel_seconds
    timings.wire_bytes += round_.wire_bytes
    timings.pipelined_rounds += int(round_.pipelined)
    timings.batch_sizes[round_.batch_size] = timings.batch_sizes.get(round_.batch_size, 0) + 1
    timings.rounds_by_k[round_.k] = timings.rounds_by_k.get(round_.k, 0) + 1
    accepted = timings.accepted_per_position
    accepted.extend([0] * (round_.k - len(accepted)))
    for position in range(round_.num_accepted):
        accepted[position] += 1
    if round_.k:
        stats.num_drafts += 1
        stats.num_draft_tokens += round_.k
        stats.num_accepted_tokens += round_.num_accepted
    if metrics is not None:
        metrics.observe_round(
            round_.k, round_.num_accepted, round_.draft_seconds, round_.verify_seconds, round_.wire_seconds
        )


async def _prefill(session: _Session) -> int:
    """The session's sequence prefilled on its verifier replica; the next token."""
    request = verify_pb2.PrefillRequest(session_id=session.id, token_ids=session.sequence, sampling=session.sampling)
    response = await _call_verifier(session, "Prefill", request)
    return response.next_token_id


_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # the verifier may be restarting


async def _call_verifier(session: _Session, method: str, request):
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
            return await _traced_call(replica.stub, method, request, timeout=backends.rpc_timeout_s,
                                      wait_for_ready=len(backends.verifiers) == 1)  # fmt: skip
        except (grpc.aio.AioRpcError, NoReplica) as error:
            code = _code(session, error)
            if code not in _RETRIED or time.monotonic() + pause > deadline:
                raise
            if _move(session):
                continue  # at once, on a replica that is up
            log.warning("verifier unavailable (%s); retrying", _describe(error))
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


def _code(session: _Session, error: BaseException) -> grpc.StatusCode:
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


def _move(session: _Session) -> bool:
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
        _detach(backends, _release_on(left, session.id))
    return True


async def _draft(drafter: DraftStream, sequence: list[int], k: int, sampling, want_bonus_guess: bool = False,
                 guessed: list[int] = ()):  # fmt: skip
    """(drafts, distributions, bonus guess, seconds as seen here, the service's own seconds,
    bytes both ways, the response); no drafts (a target-only round) when the draft service fails."""
    started = time.perf_counter()
    attributes = {"rpc.system": "grpc", "rpc.service": "specserve.v1.DraftService", "rpc.method": "Draft",
                  "specserve.pipelined": bool(guessed)}  # fmt: skip
    with span("specserve.v1.DraftService/Draft propose", kind=SpanKind.CLIENT, attributes=attributes):
        try:
            response = await drafter.propose(sequence, k, sampling, inject({}), want_bonus_guess, guessed)
        except (grpc.RpcError, RuntimeError, TimeoutError, NoReplica) as error:
            _draft_failures.warning("draft failed (%s); this round runs target-only", _describe(error))
            drafter.reset()
            return [], [], -1, time.perf_counter() - started, 0.0, 0, None
    seconds = time.perf_counter() - started
    wire_bytes = drafter.last_request_bytes + response.ByteSize()
    guess = response.bonus_guess if want_bonus_guess else -1
    return (list(response.draft_token_ids), list(response.draft_distributions), guess, seconds, response.draft_seconds,
            wire_bytes, response)  # fmt: skip


async def _verify(
    session: _Session, drafts: list[int], distributions: list
) -> tuple[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse | None]:
    """The request and the verifier's answer, None when it no longer holds the session as we do."""
    request = verify_pb2.VerifyRequest(
        session_id=session.id,
        num_verified=len(session.sequence),
        draft_token_ids=drafts,
        draft_distributions=distributions,
        sampling=session.sampling,
    )
    try:
        return request, await _call_verifier(session, "Verify", request)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        log.warning("verifier session out of step (%s); prefilling again", error.details())
        return request, None


async def _decode(session: _Session, request: verify_pb2.DecodeRequest, parent: Context | None):
    """The Decode stream's tokens as rounds, under one client span when tracing is on (not
    made current: the consumer runs between tokens). A round's verify time is the gap since
    the previous token arrived (the call's start, for the first), matching the service's
    server_seconds. Each token must arrive within rpc_timeout_s of the one before
    (TimeoutError otherwise); the call is cancelled when the consumer stops early, which is
    no error."""
    call_span = start_span(f"{VERIFY_SERVICE}/Decode", kind=SpanKind.CLIENT, context=parent,
                           attributes=_DECODE_ATTRIBUTES)  # fmt: skip
    call, status = None, grpc.StatusCode.OK
    try:
        last = time.perf_counter()
        backends = session.backends
        stub = session.route.current().stub
        call = stub.Decode(request, metadata=metadata_with_trace_context(call_span),
                           wait_for_ready=len(backends.verifiers) == 1)  # fmt: skip
        wire_bytes = request.ByteSize()  # counted with the first round
        while (response := await asyncio.wait_for(call.read(), backends.rpc_timeout_s)) is not grpc.aio.EOF:
            now = time.perf_counter()
            yield _decoded_round(response, now - last, wire_bytes + response.ByteSize())
            last, wire_bytes = now, 0
    except grpc.aio.AioRpcError as error:
        status = error.code()
        raise
    except (TimeoutError, asyncio.CancelledError):
        status = grpc.StatusCode.CANCELLED
        raise
    finally:  # GeneratorExit (the consumer has what it wanted) ends the span as OK
        if call is not None:
            call.cancel()  # nothing when it has finished
        if call_span.is_recording():
            set_rpc_status(call_span, status)
            call_span.end()


_DECODE_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": VERIFY_SERVICE, "rpc.method": "Decode"}


def _decoded_round(response: verify_pb2.DecodeResponse, seconds: float, wire_bytes: int) -> Round:
    """A Decode stream's round; seconds: since the previous one arrived. Its drafting (when the
    verifier drafted it) counts as draft time, the rest as verify time."""
    draft = response.draft_seconds
    return Round(
        new_tokens=[*response.accepted_token_ids, response.token_id],
        k=response.num_draft_tokens,
        num_accepted=len(response.accepted_token_ids),
        batch_size=response.batch_size,
        draft_seconds=draft,
        draft_server_seconds=draft,
        verify_seconds=max(0.0, seconds - draft),
        verify_server_seconds=max(0.0, response.server_seconds - draft),
        verify_forward_seconds=response.forward_seconds,
        verify_kernel_seconds=response.kernel_seconds,
        wire_bytes=wire_bytes,
    )


async def _traced_call(stub, method: str, request, **options):
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


async def _release(session: _Session) -> None:
    """Frees the session on its replica (none was picked, or it left: nothing to free)."""
    if session.route.replica is not None and not session.route.replica.gone:
        await _release_on(session.route.replica, session.id)


async def _release_on(replica, session_id: str) -> None:
    request = verify_pb2.ReleaseRequest(session_id=session_id)
    try:
        await _traced_call(replica.stub, "Release", request, timeout=5)
    except Exception as error:  # noqa: BLE001 - a release that fails leaves the session to the TTL, never fails a request
        log.warning("release of session %s on %s failed: %s", session_id, replica.address, _describe(error))


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
