"""The drafter: extends each session's draft KV cache with the newly verified tokens and
proposes K draft tokens, each with the exact sparse distribution q_i it was drawn from.

q_i is the draft's processed distribution (the request's temperature, top-k and top-p applied
to the draft logits) truncated to the support_size most likely tokens and renormalised
(DESIGN.md, invariant 2). Greedy requests get argmax drafts and no distributions.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from draft_service.config import DraftConfig
from specserve.errors import FailedPrecondition, RequestError, ResourceExhausted, require
from specserve.models import CachedSequence, LoadedModel
from specserve.protocol import SparseDistribution, check_token_ids
from specserve.sampling import SamplingParams, processed_probs, sample_sparse, truncate_to_support

log = logging.getLogger(__name__)


@dataclass
class DraftSession:
    """Owned by one stream; only the batcher's worker thread touches its cache."""

    session_id: str
    cache: CachedSequence
    verified: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache


@dataclass(frozen=True)
class DraftJob:
    session: DraftSession
    tokens: tuple[int, ...]  # verified tokens appended since the previous request
    num_verified: int
    num_speculative_tokens: int
    sampling: SamplingParams


@dataclass(frozen=True)
class Proposal:
    num_verified: int
    draft_token_ids: tuple[int, ...]
    draft_distributions: tuple[SparseDistribution, ...]


class Drafter:
    def __init__(self, loaded: LoadedModel, config: DraftConfig):
        self.loaded = loaded
        self.config = config
        self._open_sessions = 0
        self._lock = threading.Lock()  # open/close come from stream threads

    def open_session(self, session_id: str) -> DraftSession:
        with self._lock:
            if self._open_sessions >= self.config.max_sessions:
                raise ResourceExhausted(f"the draft service holds its maximum of {self.config.max_sessions} sessions")
            self._open_sessions += 1
        return DraftSession(session_id, CachedSequence(self.loaded))

    def close_session(self, session: DraftSession) -> None:
        with self._lock:
            self._open_sessions -= 1

    def step(self, jobs: list[DraftJob]) -> list[Proposal | BaseException]:
        results: list[Proposal | BaseException] = []
        for job in jobs:
            try:
                results.append(self._propose(job))
            except Exception as error:  # noqa: BLE001 - one bad request must not fail its batch
                if not isinstance(error, RequestError):
                    log.exception("drafting failed")
                results.append(error)
        return results

    def _propose(self, job: DraftJob) -> Proposal:
        session = job.session
        self._check(job)
        verified = session.verified + list(job.tokens)
        logits = self._catch_up(session, verified)  # [vocab]
        room = self.loaded.max_context_length - len(verified)
        k = max(0, min(job.num_speculative_tokens, room))
        drafts: list[int] = []
        distributions: list[SparseDistribution] = []
        for i in range(k):
            token, distribution = self._draw(logits, job.sampling, position=len(verified) + i)
            drafts.append(token)
            if distribution is not None:
                distributions.append(distribution)
            if i + 1 < k:
                logits = session.cache.extend([token])[-1]
                session.cached_tokens.append(token)
        session.verified = verified
        return Proposal(len(verified), tuple(drafts), tuple(distributions))

    def _check(self, job: DraftJob) -> None:
        start = job.num_verified - len(job.tokens)
        if start != len(job.session.verified):
            raise FailedPrecondition(
                f"draft session holds {len(job.session.verified)} verified tokens, request assumes {start}",
                len(job.session.verified),
            )
        require(job.num_verified >= 1, "the verified sequence must not be empty")
        require(
            1 <= job.num_speculative_tokens <= self.config.max_speculative_tokens,
            f"num_speculative_tokens must lie in 1..{self.config.max_speculative_tokens}",
        )
        check_token_ids(job.tokens, self.loaded.vocab_size, "tokens")
        require(job.num_verified <= self.loaded.max_context_length, "the sequence exceeds the draft's context window")

    def _catch_up(self, session: DraftSession, verified: list[int]) -> torch.Tensor:
        """Crops the cache to its longest prefix still verified (accepted drafts stay) and
        feeds the rest; returns the logits after the last verified token."""
        keep = _common_prefix(session.cached_tokens, verified)
        keep = min(keep, len(verified) - 1)  # the last verified token must be fed for its logits
        session.cache.truncate(keep)
        logits = session.cache.extend(verified[keep:])[-1]
        session.cached_tokens = list(verified)
        return logits

    def _draw(
        self, logits: torch.Tensor, sampling: SamplingParams, position: int
    ) -> tuple[int, SparseDistribution | None]:
        if sampling.is_greedy:
            return int(torch.argmax(logits)), None
        probs = processed_probs(logits[None], sampling)[0]  # [vocab]
        ids, q = truncate_to_support(probs, self.config.support_size)
        token = sample_sparse(ids, q, sampling.seed, position)
        return token, SparseDistribution(tuple(ids.tolist()), tuple(q.tolist()))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
