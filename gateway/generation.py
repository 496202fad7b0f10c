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

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from gateway.accounting import SpeculationStats, account
from gateway.clients import Backends, DraftStream
from gateway.logprobs import Logprobs
from gateway.replicas import NoReplica, Route
from gateway.rounds import TARGET_ONLY_STRETCH, GenerationPlan, Proposal, Round, round_attributes
from gateway.verifier_client import RETRIED, decode, describe, detach, move, prefill, release, status_code, verify
from specserve.adaptive import KChooser
from specserve.methods.trees import TreeShape
from specserve.serving.logs import RateLimitedLog
from specserve.serving.metrics import GatewayMetrics
from specserve.serving.telemetry import inject, span
from specserve.speculation import Speculation
from specserve.v1 import draft_pb2, verify_pb2

__all__ = ["GenerationPlan", "SpeculationStats", "generate"]

log = logging.getLogger(__name__)

_draft_failures = RateLimitedLog(log)


async def generate(
    backends: Backends,
    plan: GenerationPlan,
    stats: SpeculationStats,
    parent: Context | None = None,
    metrics: GatewayMetrics | None = None,
    crowded: Callable[[], bool] | None = None,
    logprobs: Logprobs | None = None,
    prefilled: asyncio.Future | None = None,
    leads: bool = True,
) -> AsyncIterator[list[int]]:
    """Yields each round's new verified tokens; closing the iterator ends both sessions.
    Spans (prefill, one per round) are children of parent; each round feeds metrics.
    Target-only requests decode in one Decode stream; a speculative one decodes target-only
    stretches while its draft service is unavailable or, where the plan yields to load,
    crowded() says too many requests run. logprobs, where given, gets the prompt's (where the
    plan asks) and each token's (where its sampling asks) as they come. prefilled: shared by
    the choices of one request: the first (leads) sets it to its session once prefilled, the
    others wait for it and have the verifier copy that session's cache of the prompt."""
    if not plan.yields_to_load:
        crowded = None
    session = _Session(backends, plan, uuid.uuid4().hex, logprobs)
    try:
        with span("prefill", context=parent):
            response = await _first_prefill(session, prefilled, leads)
        if plan.max_tokens == 0:  # the prompt's logprobs only (echo)
            return
        session.accept([response.next_token_id], _next_logprob(response))
        yield [response.next_token_id]
        generated = 1
        while generated < plan.max_tokens:
            remaining = plan.max_tokens - generated
            stretch = session.next_stretch(remaining, busy=crowded is not None and crowded())
            if stretch is not None:  # a Decode stream: the verifier's own rounds, or target-only
                speculation, wanted = stretch
                made = 0
                async with aclosing(session.decode(wanted, parent, speculation)) as rounds:
                    async for round_ in rounds:
                        account(round_, stats, metrics)
                        made += len(round_.new_tokens)
                        yield round_.new_tokens
                generated += made
                if made < wanted:  # the stream ended early: an end-of-sequence token
                    return
                continue
            with span("round", context=parent) as round_span:
                round_ = await session.round(session.k, remaining=remaining, tree=session.tree)
                if round_span.is_recording():
                    round_span.set_attributes(round_attributes(round_))
            account(round_, stats, metrics)
            session.observe(round_)
            session.accept(round_.new_tokens, round_.logprobs)
            generated += len(round_.new_tokens)
            yield round_.new_tokens
    finally:
        if prefilled is not None and leads and not prefilled.done():
            prefilled.set_result("")  # its prefill failed: each other choice prefills itself
        await _close_detached(backends, session)


async def _first_prefill(session, prefilled: asyncio.Future | None, leads: bool) -> verify_pb2.PrefillResponse:
    """A request's first prefill: the prompt's logprobs where asked; a choice after the first
    has the verifier copy the first's cache of the prompt."""
    source = await asyncio.shield(prefilled) if prefilled is not None and not leads else ""
    response = await prefill(session, session.plan.prompt_logprobs, source)
    if prefilled is not None and leads:
        prefilled.set_result(session.id)
    if session.logprobs is not None:
        session.logprobs.prompt = list(response.prompt_logprobs)
    return response


def _next_logprob(response: verify_pb2.PrefillResponse) -> list:
    return [response.next_token_logprob] if response.HasField("next_token_logprob") else []


async def _close_detached(backends: Backends, session) -> None:
    """Closes both sessions even when the request is being cancelled (its client went away):
    the release runs as a task of its own, which the cancellation does not reach, held in
    backends.detached until it is done."""
    await asyncio.shield(detach(backends, session.close()))


class _Session:
    """One request's state across rounds: its sequence, its draft stream and K choice (for a
    draft service's rounds), and the proposal drafted ahead for the next round when
    pipelining."""

    def __init__(self, backends: Backends, plan: GenerationPlan, session_id: str, logprobs: Logprobs | None = None):
        self.backends = backends
        self.logprobs = logprobs
        self.plan = plan
        self.id = session_id
        self.sampling = plan.sampling.to_proto()
        self.sequence = list(plan.prompt_token_ids)
        self.route = Route(backends.verifiers, session_id)  # the verifier replica that holds it
        remote = plan.method != "none" and not plan.local
        self.drafter = (
            DraftStream(
                backends,
                session_id,
                method=plan.method,
                min_draft_probability=plan.min_draft_probability,
                tenant=plan.tenant,
                isolated=plan.isolated,
                prompt_length=len(plan.prompt_token_ids),
            )
            if remote
            else None
        )
        sampled = not plan.sampling.is_greedy
        self.chooser = KChooser(plan.speculation, backends.shared, sampled=sampled) if remote else None
        self.drafted_rounds = 0
        self.last_k = 0  # the K of the round before
        self.k = 0  # the next remote round's K
        self.tree: TreeShape | None = None  # the next remote round's tree, where it is one
        self.stretch = TARGET_ONLY_STRETCH[0]
        self.pipeline = _Pipeline(self)  # drafting ahead: a draft service's rounds only

    def accept(self, tokens: list[int], logprobs=()) -> None:
        """The one place a request's sequence grows: tokens the verifier decided, in order
        (docs/design.md, invariant 3), with their logprobs where asked."""
        self.sequence.extend(tokens)
        if self.logprobs is not None and self.plan.sampling.logprobs:
            self.logprobs.tokens.extend(logprobs)

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
            self.pipeline.forget()  # drafted for a sequence these tokens replace
            wanted, self.stretch = min(self.stretch, remaining), min(2 * self.stretch, TARGET_ONLY_STRETCH[1])
            return None, wanted
        self.stretch = TARGET_ONLY_STRETCH[0]
        choice = self.chooser.next_round(remaining)
        self.k, self.tree = choice.k, choice.tree
        if self.k == 0:  # drafts do not pay now: target-only tokens until the chooser tries again
            self.pipeline.forget()
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
            self.chooser.observe(round_.k, round_.num_accepted, draft, verify, round_.seconds, round_.tree)

    async def decode(
        self, remaining: int, parent: Context | None, speculation: Speculation | None = None
    ) -> AsyncIterator[Round]:
        """Rounds from Decode streams, the verifier's own (speculation set) or target-only
        tokens: one stream for all of them unless the verifier loses the session, which is
        prefilled again (one token) and decoding goes on. Each round's tokens join the
        sequence before it is yielded."""
        while remaining > 0:
            request = verify_pb2.DecodeRequest(
                session_id=self.id,
                num_verified=len(self.sequence),
                max_tokens=remaining,
                sampling=self.sampling,
                speculation=speculation.to_proto() if speculation is not None else None,
            )
            try:
                async with aclosing(decode(self, request, parent)) as rounds:
                    async for round_ in rounds:
                        self.accept(round_.new_tokens, round_.logprobs)
                        remaining -= len(round_.new_tokens)
                        if speculation is None:
                            self.observe(round_)
                        yield round_
                return  # the stream ended: all made, an end-of-sequence token, or the context is full
            except (grpc.aio.AioRpcError, TimeoutError, NoReplica) as error:
                code = status_code(self, error)
                if code not in (grpc.StatusCode.FAILED_PRECONDITION, *RETRIED):
                    raise
                log.warning("decode stream broken (%s); prefilling again", describe(error))
                if code in RETRIED:
                    move(self)  # another replica prefills it, where one is up
            started = time.perf_counter()
            with span("prefill", context=parent):
                response = await prefill(self)
            token = response.next_token_id
            self.accept([token], _next_logprob(response))
            remaining -= 1
            yield Round(
                new_tokens=[token],
                k=0,
                num_accepted=0,
                batch_size=1,
                draft_seconds=0.0,
                draft_server_seconds=0.0,
                verify_seconds=time.perf_counter() - started,
                verify_server_seconds=0.0,
            )

    async def round(self, k: int, remaining: int, tree: TreeShape | None = None) -> Round:
        """A round of a draft service's: k drafts, or the tree (not drafted ahead)."""
        proposal = await self.pipeline.proposal(k, tree)
        drafts = proposal.drafts
        started = time.perf_counter()
        verifying = asyncio.ensure_future(verify(self, drafts, proposal.distributions, proposal.parents))
        ahead = self.pipeline.draft_ahead(drafts, proposal.bonus_guess, remaining) if not proposal.parents else None
        request, response = await verifying
        verify_s = time.perf_counter() - started
        await self.pipeline.settle(ahead, drafts, proposal.bonus_guess, response)
        if response is None:  # the verifier lost the session: prefilled again, one token
            prefilled = await prefill(self)
            return Round(
                new_tokens=[prefilled.next_token_id],
                logprobs=tuple(_next_logprob(prefilled)),
                k=0,
                num_accepted=0,
                batch_size=1,
                draft_seconds=proposal.seconds,
                draft_server_seconds=proposal.server_seconds,
                verify_seconds=time.perf_counter() - started,
                verify_server_seconds=0.0,
            )
        kept = response.accepted_token_ids if proposal.parents else drafts[: response.num_accepted]
        new = [*kept, response.next_token_id]
        wire_bytes = proposal.wire_bytes + request.ByteSize() + response.ByteSize()
        return Round(
            new_tokens=new,
            k=len(drafts),
            num_accepted=response.num_accepted,
            batch_size=response.batch_size,
            draft_seconds=proposal.seconds,
            draft_server_seconds=proposal.server_seconds,
            verify_seconds=verify_s,
            verify_server_seconds=response.server_seconds,
            verify_forward_seconds=response.forward_seconds,
            verify_kernel_seconds=response.kernel_seconds,
            verify_mask_seconds=response.mask_seconds,
            wire_bytes=wire_bytes,
            pipelined=proposal.seconds == 0 and bool(drafts),
            tree=bool(proposal.parents),
            logprobs=tuple(response.logprobs),
        )

    async def close(self) -> None:
        if self.drafter is not None:
            await self.drafter.close()
        await release(self)


class _Pipeline:
    """A draft service's rounds drafted ahead (plan.pipeline): while round r is verified, round
    r + 1 is drafted as if every draft of r and the draft's own bonus guess were kept; the
    proposal is used where that came true and forgotten otherwise. All the gateway's state of
    it is here (the draft service keeps the draft's cache of the guessed tokens until
    confirmed)."""

    def __init__(self, session: _Session):
        self.session = session
        self.prefetched: draft_pb2.DraftResponse | None = None  # drafted ahead, held for the next round

    def forget(self) -> None:
        self.prefetched = None

    async def proposal(self, k: int, tree: TreeShape | None = None) -> Proposal:
        """The proposal drafted ahead if there is one (for a chain), else a fresh one (none for k = 0)."""
        session = self.session
        if self.prefetched is not None and k > 0 and tree is None:
            ahead, self.prefetched = self.prefetched, None
            drafts = list(ahead.draft_token_ids[:k])
            guess = ahead.bonus_guess if len(drafts) == len(ahead.draft_token_ids) else -1
            return Proposal(drafts, list(ahead.draft_distributions[:k]), guess, 0.0, 0.0, ahead.ByteSize())
        self.prefetched = None
        if k == 0:
            return Proposal([], [], -1, 0.0, 0.0, 0)
        if tree is not None:
            return await _draft(session.drafter, session.sequence, k, session.sampling, tree=tree)
        return await _draft(session.drafter, session.sequence, k, session.sampling, session.plan.pipeline)

    def draft_ahead(self, drafts: list[int], guess: int, remaining: int) -> asyncio.Future | None:
        """While the verifier checks this round, drafts the next one as if every draft and the
        draft's own bonus guess were accepted."""
        session = self.session
        if not (session.plan.pipeline and drafts and guess >= 0):
            return None
        k_next = min(
            session.chooser.k_after_all_kept(len(drafts), remaining - len(drafts) - 1), remaining - len(drafts) - 2
        )
        if k_next < 1:
            return None
        guessed = [*drafts, guess]
        return asyncio.ensure_future(_draft(session.drafter, session.sequence, k_next, session.sampling, True, guessed))

    async def settle(self, ahead, drafts: list[int], guess: int, response) -> None:
        """Keeps the proposal drafted ahead where the round kept every draft and the guess."""
        if ahead is None:
            return
        proposal = await ahead
        held = response is not None and response.num_accepted == len(drafts) and response.next_token_id == guess
        if held and proposal.drafts:
            self.session.drafter.confirm(len(self.session.sequence) + len(drafts) + 1)
            self.prefetched = proposal.response


async def _draft(
    drafter: DraftStream,
    sequence: list[int],
    k: int,
    sampling,
    want_bonus_guess: bool = False,
    guessed: list[int] = (),
    tree: TreeShape | None = None,
) -> Proposal:
    """A draft service's proposal of k tokens after sequence (after guessed too, when drafting
    ahead), or of a tree of k nodes; no drafts (a target-only round) when the draft service fails."""
    started = time.perf_counter()
    attributes = {
        "rpc.system": "grpc",
        "rpc.service": "specserve.v1.DraftService",
        "rpc.method": "Draft",
        "specserve.pipelined": bool(guessed),
    }
    with span("specserve.v1.DraftService/Draft propose", kind=SpanKind.CLIENT, attributes=attributes):
        try:
            response = await drafter.propose(sequence, k, sampling, inject({}), want_bonus_guess, guessed, tree)
        except (grpc.RpcError, RuntimeError, TimeoutError, NoReplica) as error:
            _draft_failures.warning("draft failed (%s); this round runs target-only", describe(error))
            drafter.reset()
            return Proposal([], [], -1, time.perf_counter() - started, 0.0, 0)
    return Proposal(
        drafts=list(response.draft_token_ids),
        distributions=list(response.draft_distributions),
        bonus_guess=response.bonus_guess if want_bonus_guess else -1,
        seconds=time.perf_counter() - started,
        server_seconds=response.draft_seconds,
        wire_bytes=drafter.last_request_bytes + response.ByteSize(),
        response=response,
        parents=list(response.draft_parents) if response.draft_parents else None,
    )
