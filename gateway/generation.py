"""One request's rounds: prefill, then draft -> verify until the consumer stops asking.

The gateway owns the canonical sequence (DESIGN.md, invariant 3): services hold caches that
can be rebuilt. A draft stream that fails costs one target-only round and is reopened with
the whole sequence; a verifier that lost the session is prefilled again from the sequence.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway.backends import Backends, DraftStream
from specserve.sampling import SamplingParams
from specserve.v1 import verify_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationPlan:
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    method: str  # "draft_model" or "none"
    num_speculative_tokens: int


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
    batch_sizes: dict[int, int] = field(default_factory=dict)

    def add_verify(self, seconds: float, response: verify_pb2.VerifyResponse) -> None:
        self.rounds += 1
        self.verify_seconds += seconds
        self.verify_server_seconds += response.server_seconds
        self.verify_forward_seconds += response.forward_seconds
        self.verify_kernel_seconds += response.kernel_seconds
        self.batch_sizes[response.batch_size] = self.batch_sizes.get(response.batch_size, 0) + 1

    def as_dict(self) -> dict:
        wire = (self.draft_seconds - self.draft_server_seconds) + (self.verify_seconds - self.verify_server_seconds)
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "batch_sizes"}
        return {**values, "wire_seconds": wire, "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())}}


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


async def generate(backends: Backends, plan: GenerationPlan, stats: SpeculationStats) -> AsyncIterator[list[int]]:
    """Yields each round's new verified tokens; closing the iterator ends both sessions."""
    session_id = uuid.uuid4().hex
    sampling = plan.sampling.to_proto()
    sequence = list(plan.prompt_token_ids)
    drafter = DraftStream(backends, session_id) if plan.method == "draft_model" else None
    try:
        first = await _prefill(backends, session_id, sequence, sampling)
        sequence.append(first)
        yield [first]
        generated = 1
        while generated < plan.max_tokens:
            k = min(plan.num_speculative_tokens, plan.max_tokens - generated - 1) if drafter else 0
            drafts, distributions = await _draft(drafter, sequence, k, sampling, stats) if k > 0 else ([], [])
            new_tokens = await _verify(backends, session_id, sequence, drafts, distributions, sampling, stats)
            sequence.extend(new_tokens)
            generated += len(new_tokens)
            yield new_tokens
    finally:
        if drafter is not None:
            await drafter.close()
        await _release(backends, session_id)


async def _prefill(backends: Backends, session_id: str, sequence: list[int], sampling) -> int:
    request = verify_pb2.PrefillRequest(session_id=session_id, token_ids=sequence, sampling=sampling)
    response = await backends.verify.Prefill(request, timeout=backends.rpc_timeout_s)
    return response.next_token_id


async def _draft(
    drafter: DraftStream, sequence: list[int], k: int, sampling, stats: SpeculationStats
) -> tuple[list[int], list]:
    started = time.perf_counter()
    try:
        response = await drafter.propose(sequence, k, sampling)
    except (grpc.RpcError, RuntimeError, TimeoutError) as error:
        log.warning("draft failed (%s); this round runs target-only", _describe(error))
        drafter.reset()
        return [], []
    stats.timings.draft_seconds += time.perf_counter() - started
    stats.timings.draft_server_seconds += response.draft_seconds
    return list(response.draft_token_ids), list(response.draft_distributions)


async def _verify(
    backends: Backends,
    session_id: str,
    sequence: list[int],
    drafts: list[int],
    distributions: list,
    sampling,
    stats: SpeculationStats,
) -> list[int]:
    request = verify_pb2.VerifyRequest(
        session_id=session_id,
        num_verified=len(sequence),
        draft_token_ids=drafts,
        draft_distributions=distributions,
        sampling=sampling,
    )
    started = time.perf_counter()
    try:
        response = await backends.verify.Verify(request, timeout=backends.rpc_timeout_s)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        # The verifier lost or disagrees about the session: rebuild it from our sequence.
        log.warning("verifier session out of step (%s); prefilling again", error.details())
        return [await _prefill(backends, session_id, sequence, sampling)]
    stats.timings.add_verify(time.perf_counter() - started, response)
    if drafts:
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += response.num_accepted
    return [*drafts[: response.num_accepted], response.next_token_id]


async def _release(backends: Backends, session_id: str) -> None:
    try:
        await backends.verify.Release(verify_pb2.ReleaseRequest(session_id=session_id), timeout=5)
    except grpc.RpcError as error:
        log.warning("release of session %s failed: %s", session_id, _describe(error))


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
