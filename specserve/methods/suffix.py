"""Suffix decoding's statistics: for every context of 1 .. depth tokens seen, how often each
token followed it. That is a suffix tree's counts cut at a depth (Arctic Inference's suffix
decoding keeps them in suffix trees; a table of contexts gives the same counts for matches
of up to depth tokens, and is simple to bound and evict).

A session keeps one over its own tokens (prompt and output), and the drafter one over the
sequences of finished sessions, shared by later requests of the same tenant only: each of
its contexts is keyed by the tenant, so no lookup can reach another tenant's counts. The
shared one holds at most max_contexts contexts, the least recently counted evicted first,
and each context at most MAX_FOLLOWERS followers (the rarest dropped; its total stays whole,
so a share is never overestimated).

A round's drafts follow the counts: from the longest context that matches the end of the
sequence (in either table; the session's own on a tie), the most frequent next token, then
again after it, while the path's estimated probability (the product of each step's count
share) stays at least min_probability. Drafts are a function of the sequence and the tables
as they stand, not of the target's randomness, so each one's q is one-hot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

DEPTH = 8  # longest context counted
MAX_FOLLOWERS = 16  # followers kept per context: one split further drafts nothing anyway
TOTAL = -1  # the key of a context's count of every follower, dropped ones included


class SuffixCounts:
    """What followed each context of 1 .. depth tokens, per tenant (one tenant: a session's)."""

    def __init__(self, depth: int = DEPTH, max_contexts: int | None = None):
        self.depth = depth
        self.max_contexts = max_contexts
        self.table: OrderedDict[tuple, dict[int, int]] = OrderedDict()  # (tenant, *context) -> counts

    def __len__(self) -> int:
        return len(self.table)

    def add(self, tokens: list[int], start: int = 1, tenant: str = "") -> None:
        """Counts tokens[i] after each of its contexts, for i from start (>= 1) on."""
        table, depth = self.table, self.depth
        for i in range(max(1, start), len(tokens)):
            token = tokens[i]
            for n in range(1, min(depth, i) + 1):
                key = (tenant, *tokens[i - n : i])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {TOTAL: 0}
                elif self.max_contexts is not None:
                    table.move_to_end(key)
                counts[token] = counts.get(token, 0) + 1
                counts[TOTAL] += 1
                if len(counts) > MAX_FOLLOWERS + 1:
                    del counts[min((t for t in counts if t != TOTAL), key=counts.__getitem__)]
        if self.max_contexts is not None:
            while len(table) > self.max_contexts:
                table.popitem(last=False)

    def longest_match(self, tokens: list[int], tenant: str = "") -> tuple[int, dict[int, int] | None]:
        """(n, counts) of the longest context of at most depth tokens ending tokens that was
        seen; counts[TOTAL] is how often it was."""
        for n in range(min(self.depth, len(tokens)), 0, -1):
            counts = self.table.get((tenant, *tokens[len(tokens) - n :]))
            if counts is not None:
                return n, counts
        return 0, None


def suffix_drafts(
    tables: list[tuple[SuffixCounts, str]], tokens: list[int], k: int, min_probability: float
) -> list[int]:
    """Up to k drafts after tokens from the tables ((counts, tenant), the session's first):
    each step the most frequent token after the longest matching context, while the path's
    estimated probability stays >= min_probability."""
    context, drafts, probability = list(tokens), [], 1.0
    for _ in range(k):
        best_n, best = 0, None
        for table, tenant in tables:
            n, counts = table.longest_match(context, tenant)
            if n > best_n:
                best_n, best = n, counts
        if best is None:
            break
        token, count = max(((t, c) for t, c in best.items() if t != TOTAL), key=lambda item: item[1])
        probability *= count / best[TOTAL]
        if probability < min_probability:
            break
        drafts.append(token)
        context.append(token)
    return drafts


# The shared table's bound, in contexts: about 450 bytes each with one follower, 1.3 KB with the
# most (MAX_FOLLOWERS): 90 MB to 260 MB.
MAX_SHARED_CONTEXTS = 200_000
FOLD_TOKENS = 4096  # finished sessions' tokens counted into the shared table per batch at most
QUEUED_TOKENS = 64 * FOLD_TOKENS  # finished sessions' tokens waiting at most (the oldest dropped)
MIN_PROBABILITY = 0.1  # a round's drafts stop where the path's estimated probability falls below this


@dataclass
class SuffixSession:
    """A suffix session's own table, over the tokens of its sequence counted so far."""

    tenant: str
    shared: bool = True  # whether it drafts from its tenant's finished sessions too
    table: SuffixCounts = field(default_factory=SuffixCounts)
    counted: int = 0
    prompt_length: int = -1  # the sequence's length when first drafted for: its prompt's


class SuffixStore:
    """Method suffix (a ContextProposer, specserve/methods/registry.py): the drafter's shared
    table, and the sequences of the sessions finished since its last batch (closed from
    other threads; folded in by the drafting thread)."""

    def __init__(self, max_contexts: int = MAX_SHARED_CONTEXTS, min_probability: float = MIN_PROBABILITY):
        self.shared = SuffixCounts(max_contexts=max_contexts)
        self.min_probability = min_probability
        self._finished: deque[tuple[str, list[int]]] = deque()
        self._queued = 0  # tokens in _finished
        self._lock = threading.Lock()

    def open(self, tenant: str, isolated: bool) -> SuffixSession:
        """A session's own table; isolated, it drafts from no other session's."""
        return SuffixSession(tenant, shared=not isolated)

    def finish(self, session: SuffixSession, tokens: list[int]) -> None:
        """Shares what the session's target made (with the depth of context before it) with
        its tenant's later sessions."""
        if session.prompt_length >= 0 and len(tokens) > session.prompt_length:
            made = tokens[max(0, session.prompt_length - DEPTH) :]
            with self._lock:
                self._finished.append((session.tenant, made))
                self._queued += len(made)
                while self._queued > QUEUED_TOKENS:  # more finishing than batches fold in
                    self._queued -= len(self._finished.popleft()[1])

    @property
    def queued_tokens(self) -> int:
        """Finished sessions' tokens not yet counted into the shared table."""
        return self._queued

    def _fold(self) -> None:
        """Counts finished sessions into the shared table, up to FOLD_TOKENS tokens a batch (a
        batch of many closes must not stall the drafting thread, which may be the verifier's)."""
        budget = FOLD_TOKENS
        while budget > 0:
            with self._lock:
                if not self._finished:
                    return
                tenant, tokens = self._finished.popleft()
                self._queued -= len(tokens)
            self.shared.add(tokens, tenant=tenant)
            budget -= len(tokens)

    def drafts(self, session: SuffixSession, verified: list[int], start: int, k: int) -> list[int]:
        """Up to k drafts after verified, whose tokens from start on are new to the session
        (a start before what it counted rewinds: its table is counted again)."""
        self._fold()
        if session.prompt_length < 0:
            session.prompt_length = len(verified)
        if start < session.counted:
            session.table, session.counted = SuffixCounts(), 0
        session.table.add(verified, start=session.counted)
        session.counted = len(verified)
        tables = [(session.table, ""), *([(self.shared, session.tenant)] if session.shared else [])]
        return suffix_drafts(tables, verified, k, self.min_probability)
