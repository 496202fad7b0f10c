"""The drafter: extends each session's draft KV cache with the newly verified tokens and
proposes K draft tokens, each with the exact sparse distribution q_i it was drawn from.

q_i is the draft's processed distribution (the request's temperature, top-k and top-p applied
to the draft logits) truncated to the support_size most likely tokens and renormalised
(DESIGN.md, invariant 2). Greedy requests get argmax drafts and no distributions.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from draft_service.config import DraftConfig
from specserve.backends import ForwardRow, KVSequence, forward_in_budget
from specserve.errors import FailedPrecondition, RequestError, require
from specserve.metrics import ServiceMetrics
from specserve.models import LoadedModel
from specserve.protocol import SparseDistribution, check_token_ids
from specserve.sampling import SamplingParams, processed_probs, sample_sparse, truncate_to_support

log = logging.getLogger(__name__)


@dataclass
class DraftSession:
    """Owned by one stream; only the batcher's worker thread touches its cache."""

    session_id: str
    sequence: KVSequence
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
    batch_size: int = 1
    batch_started_ns: int = 0  # wall-clock (time.time_ns) start and end of the batch
    batch_ended_ns: int = 0


@dataclass
class _Drafting:
    """One job's progress through a batch."""

    job: DraftJob
    verified: list[int]
    k: int
    drafts: list[int] = field(default_factory=list)
    distributions: list[SparseDistribution] = field(default_factory=list)


class Drafter:
    def __init__(self, loaded: LoadedModel, config: DraftConfig, metrics: ServiceMetrics | None = None):
        self.loaded = loaded
        self.backend = loaded.backend
        self.config = config
        self.metrics = metrics
        self._lock = threading.Lock()  # open and close come from stream threads

    def open_session(self, session_id: str) -> DraftSession:
        with self._lock:
            session = DraftSession(session_id, self.backend.open())  # raises ResourceExhausted when full
            self._observe_sessions()
            return session

    def close_session(self, session: DraftSession) -> None:
        with self._lock:
            self.backend.close(session.sequence)
            self._observe_sessions()

    def _observe_sessions(self) -> None:
        if self.metrics is not None:
            self.metrics.active_sessions.set(self.backend.in_use)
            self.metrics.kv_slots_in_use.set(self.backend.in_use)

    def step(self, jobs: list[DraftJob]) -> list[Proposal | BaseException]:
        """Drafts for every session of the batch together: one forward to catch up on the
        verified tokens, then one forward per draft position over the rows still drafting."""
        results: list[Proposal | BaseException | None] = [None] * len(jobs)
        active: list[tuple[int, _Drafting]] = []
        for index, job in enumerate(jobs):
            try:
                active.append((index, self._start(job)))
            except Exception as error:  # noqa: BLE001 - one bad request must not fail its batch
                if not isinstance(error, RequestError):
                    log.exception("drafting failed")
                results[index] = error
        started = time.time_ns()
        try:
            self._draft_all([drafting for _, drafting in active])
        except BaseException:
            for _, drafting in active:  # the caches may hold half a round: resync from scratch
                drafting.job.session.cached_tokens = []
                drafting.job.session.sequence.truncate(0)
            raise
        ended = time.time_ns()
        for index, drafting in active:
            drafting.job.session.verified = drafting.verified
            results[index] = Proposal(
                len(drafting.verified),
                tuple(drafting.drafts),
                tuple(drafting.distributions),
                len(active),
                started,
                ended,
            )
        if self.metrics is not None and active:
            self.metrics.batch_size.observe(len(active))
            self.metrics.forward_seconds.observe((ended - started) / 1e9)
        return results  # type: ignore[return-value]

    def _start(self, job: DraftJob) -> _Drafting:
        self._check(job)
        verified = job.session.verified + list(job.tokens)
        room = self.loaded.max_context_length - len(verified)
        return _Drafting(job, verified, max(0, min(job.num_speculative_tokens, room)))

    def _draft_all(self, batch: list[_Drafting]) -> None:
        rows = [self._catch_up_row(d) for d in batch]
        logits = [x[-1] for x in forward_in_budget(self.backend, rows, self.config.max_batched_tokens)]  # [vocab] each
        for i in range(max((d.k for d in batch), default=0)):
            for d, row_logits in zip(batch, logits):
                if d.k > i:
                    token, distribution = self._draw(row_logits, d.job.sampling, position=len(d.verified) + i)
                    d.drafts.append(token)
                    if distribution is not None:
                        d.distributions.append(distribution)
            continuing = [b for b, d in enumerate(batch) if i + 1 < d.k]
            if not continuing:
                return
            feed = [ForwardRow(batch[b].job.session.sequence, [batch[b].drafts[-1]], 1) for b in continuing]
            for b, new_logits in zip(continuing, self.backend.forward(feed)):
                batch[b].job.session.cached_tokens.append(batch[b].drafts[-1])
                logits[b] = new_logits[-1]

    def _catch_up_row(self, d: _Drafting) -> ForwardRow:
        """Crops the cache to its longest prefix still verified (accepted drafts stay) and
        feeds the rest, ending with the last verified token, whose logits start the draft."""
        session = d.job.session
        keep = min(_common_prefix(session.cached_tokens, d.verified), len(d.verified) - 1)
        session.sequence.truncate(keep)
        session.cached_tokens = list(d.verified)
        return ForwardRow(session.sequence, d.verified[keep:], 1)

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
