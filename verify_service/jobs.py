"""What the verifier's worker takes (a job per call) and gives back (an Outcome per round),
and the sessions it keeps. Words as in docs/design.md, "Words"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.errors import require
from specserve.grammar import GrammarState
from specserve.logprobs import TokenLogprob
from specserve.model.backends import KVSequence
from specserve.protocol import SparseDistribution, check_token_ids
from specserve.sampling import SamplingParams
from specserve.speculation import Speculation
from verify_service.local_drafts import SessionDrafts


@dataclass(frozen=True)
class PrefillJob:
    session_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    prompt_logprobs: int | None = None  # each token's logprob after the tokens before it, with this many top ones
    copy_of: str = ""  # a session whose cache of token_ids is copied, where it holds them
    prompt_length: int = 0  # of token_ids, the prompt's (0: all); the rest is output
    grammar: GrammarState | None = None  # the output's grammar, after the output sent


@dataclass(frozen=True)
class VerifyJob:
    session_id: str
    num_verified: int
    draft_token_ids: tuple[int, ...]
    draft_distributions: tuple[SparseDistribution, ...]
    sampling: SamplingParams | None  # None: the session's own
    draft_parents: tuple[int, ...] = ()  # a token tree's: each draft's parent (0 the root); () a chain

    def check_drafts(self, sampling: SamplingParams, max_speculative_tokens: int, loaded) -> None:
        """InvalidArgument where the drafts are more than the verifier takes, reach past the
        context window or the vocabulary, or do not agree with their distributions."""
        k = len(self.draft_token_ids)
        require(
            k <= max_speculative_tokens,
            f"at most {max_speculative_tokens} draft tokens per call, got {k}",
        )
        require(
            self.num_verified + k <= loaded.max_context_length,
            f"{self.num_verified} verified + {k} draft tokens exceed the context window of {loaded.max_context_length}",
        )
        check_token_ids(self.draft_token_ids, loaded.vocab_size, "draft_token_ids")
        if sampling.is_greedy:
            require(not self.draft_distributions, "greedy requests carry no draft distributions")
            return
        require(
            len(self.draft_distributions) == k,
            f"{k} draft tokens need {k} draft distributions, got {len(self.draft_distributions)}",
        )
        for i, (token, distribution) in enumerate(zip(self.draft_token_ids, self.draft_distributions)):
            require(distribution.prob_of(token) > 0, f"draft token {i} ({token}) has no mass in its own distribution")


@dataclass(frozen=True)
class DecodeJob:
    """Up to max_tokens tokens, one round per batch: target-only, or speculative with local
    drafts when speculation is set. emit gets each round's Outcome on the worker thread;
    ended, once set (the call is over), stops the decode before its next round, or before
    its first."""

    session_id: str
    num_verified: int
    max_tokens: int
    sampling: SamplingParams | None
    emit: Callable[[Outcome], None]
    ended: threading.Event
    session: Session | None = None  # the session it decodes into, from its first token on
    speculation: Speculation | None = None

    def as_verify(self) -> VerifyJob:
        return VerifyJob(self.session_id, self.num_verified, (), (), self.sampling)


@dataclass(frozen=True)
class ReleaseJob:
    session_id: str


@dataclass(frozen=True)
class SweepJob:
    """Releases sessions idle for longer than the session TTL (a gateway that died cannot)."""

    now: float


Job = PrefillJob | VerifyJob | DecodeJob | ReleaseJob | SweepJob


@dataclass(frozen=True)
class Outcome:
    num_accepted: int
    next_token_id: int
    num_verified: int
    batch_size: int
    accepted_token_ids: tuple[int, ...] = ()  # the drafts kept, before next_token_id
    num_draft_tokens: int = 0  # K verified
    tree: bool = False  # the drafts were a token tree
    forced: bool = False  # the drafts were the tokens the session's grammar forced (jump-forward)
    mask_seconds: float = 0.0  # of the session's grammar masks (alongside the forward)
    logprobs: tuple[TokenLogprob, ...] = ()  # with sampling.logprobs: the accepted tokens', then next_token_id's
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # a prefill's, asked for: its tokens' from the second on
    # Wall-clock times (time.time_ns) of the batch this call ran in: drafting (colocated;
    # 0 when none), start of the forward, forward done, decision done. Spans and metrics are
    # made from them on the caller's thread.
    draft_started_ns: int = 0
    draft_ended_ns: int = 0
    batch_started_ns: int = 0
    forward_ended_ns: int = 0
    decided_ns: int = 0
    # The batch's make-up, for the K choice (specserve/adaptive.py, Batch): its rows, the
    # tokens its forward read, the draft tokens among them, and whether a prompt was read.
    batch_sessions: int = 0
    batch_tokens: int = 0
    batch_draft_tokens: int = 0
    batch_prefill: bool = False
    batch_caught_up: bool = False  # a draft model first read more than a round made (DraftTiming.caught_up)
    batch_draft_ns: int = 0  # the batch's drafting, for every row (a row's own draft_*_ns: where it drafted)

    @property
    def draft_seconds(self) -> float:
        return (self.draft_ended_ns - self.draft_started_ns) / 1e9

    @property
    def forward_seconds(self) -> float:
        return (self.forward_ended_ns - self.batch_started_ns) / 1e9

    @property
    def kernel_seconds(self) -> float:
        return (self.decided_ns - self.forward_ended_ns) / 1e9


@dataclass
class Session:
    tokens: list[int]  # the verified sequence; its last token is not yet in the cache
    sequence: KVSequence
    sampling: SamplingParams
    last_used: float = field(default_factory=time.monotonic)
    drafts: SessionDrafts | None = None  # colocated drafting, from its first speculative decode
    last_decided_ns: int = 0  # a decode's previous round; 0 before the first round of a Decode call
    # The target's normed hidden state [hidden] at the position whose logits gave the last
    # token (None on the transformers backend): Medusa heads draft the next round from it.
    hidden: torch.Tensor | None = field(default=None, repr=False)
    prompt_length: int = 0  # of tokens, the prompt's: logits processing counts the output after it
    grammar: GrammarState | None = None  # what its output follows (structured outputs), after its tokens


@dataclass
class Row:
    """One session's share of a verifier's batch: what it feeds the forward, then its logits."""

    session_id: str
    session: Session
    feed: list[int]  # tokens appended to the cache: the prompt, or [last verified, d_1..d_K]
    drafts: tuple[int, ...]
    distributions: tuple[SparseDistribution, ...]
    sampling: SamplingParams
    first_position: int  # sequence position of d_1 (or of the token after a prefill)
    is_new: bool  # a prefill that opened a new KV sequence
    is_prefill: bool
    logits: torch.Tensor | None = None  # [num_draft + 1, vocab] float32
    argmax: list[int] | None = None  # of each of the logits, where the forward made it with them
    batch_size: int = field(default=1)
    drafted_locally: bool = False  # a speculative decode's round with drafts, the verifier's own
    forced: bool = False  # its drafts are its grammar's forced tokens (jump-forward)
    grammar_paths: list | None = None  # the round's tokens before each position its grammar masks
    grammar_masks: object | None = None  # their masks as bits, int32 [positions, words] (numpy)
    mask_seconds: float = 0.0
    parents: list[int] | None = None  # a token tree's: the parent of each node of feed (root -1)
    path: list[int] | None = None  # a token tree's nodes kept, from its decision
    window: int = 0  # a lookahead round's last nodes: its Jacobi window, which the decision does not read
    window_whole: bool = True  # whether all of the window's nodes were fed (a tree pruned to free slots: not)
    prompt_logprobs: list | None = None  # a prefill's, asked for: its prompt tokens' from the second on
    prompt_top: int = 0  # the likeliest tokens' logprobs beside each prompt token's


def batch_timing(rows: list[Row], started_ns: int, forwarded_ns: int, draft_ns: int = 0) -> dict:
    """A decided batch's times and make-up, as Outcome fields (draft_ns: its drafting): the
    make-up is what the K choice weighs a round's cost against."""
    return {
        "batch_draft_ns": draft_ns,
        "batch_started_ns": started_ns,
        "forward_ended_ns": forwarded_ns,
        "decided_ns": time.time_ns(),
        "batch_sessions": len(rows),
        "batch_tokens": sum(len(row.feed) for row in rows),
        "batch_draft_tokens": sum(len(row.drafts) for row in rows),
        "batch_prefill": any(row.is_prefill for row in rows),
    }
