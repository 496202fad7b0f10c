"""Drafts from the sequence itself: what followed an earlier occurrence of its end. The
ngram method drafts with it alone, and a model's chain of drafts starts with it where the
context repeats and such copies have held the target's tokens at least as often as the
model's own drafts (CopyScore; specserve/drafting.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.protocol import SparseDistribution


def ngram_drafts(tokens: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    tokens (of at most max_n tokens) that occurred before; [] when no suffix of at least
    min_n tokens repeats. One pass back over the sequence, comparing only where its last
    token recurs."""
    length = len(tokens)
    if length < 2:
        return []
    last = tokens[-1]
    best_n, best_end = 0, -1
    for end in range(length - 2, -1, -1):  # where an earlier occurrence of the suffix ends
        if tokens[end] != last:
            continue
        n = 1
        while n < max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < max(1, min_n):
        return []
    return tokens[best_end + 1 : best_end + 1 + k]


class NgramProposer:
    """Method ngram (a ContextProposer, specserve/methods/registry.py): ngram_drafts, with no
    state of its own; the longest suffix looked up is max_n tokens."""

    def __init__(self, max_n: int):
        self.max_n = max_n

    def open(self, tenant: str, isolated: bool) -> None:
        return None

    def drafts(self, state: None, verified: list[int], start: int, k: int) -> list[int]:
        return ngram_drafts(verified, k, self.max_n)

    def finish(self, state: None, tokens: list[int]) -> None:
        pass


def one_hot(tokens: list[int]) -> list[SparseDistribution]:
    """The distributions of drafts copied from the sequence: each its token's, one-hot."""
    return [SparseDistribution((t,), (1.0,)) for t in tokens]


DECAY = 0.98  # per judged position: a session's text changes as it goes


@dataclass
class _Rate:
    """How often drafts of one kind held the target's token, decayed; 1/2 before any."""

    right: float = 1.0
    judged: float = 2.0

    def add(self, right: bool) -> None:
        self.right = DECAY * self.right + right
        self.judged = DECAY * self.judged + 1


@dataclass
class CopyScore:
    """Whether a session's model drafts should start with a copy of its context: how often a
    copy and the model's own drafts held the target's token, at the positions of the rounds
    that judged them (up to and including a round's first rejected draft), decayed. Where a
    round drafted from the model though a copy existed, the copy is judged too, as if
    proposed. A copy is taken while its rate is at least the model's; both start at 1/2."""

    copy: _Rate = field(default_factory=_Rate)
    model: _Rate = field(default_factory=_Rate)
    last: tuple[int, tuple[int, ...], tuple[int, ...], int] | None = None  # position, drafts, copy, copied

    def prefers_copy(self) -> bool:
        return self.copy.right * self.model.judged >= self.model.right * self.copy.judged

    def proposed(self, position: int, drafts: list[int], copy: list[int], copied: int) -> None:
        """A round's drafts from position on, the copy the context offered and how many of them it gave."""
        self.last = (position, tuple(drafts), tuple(copy), copied)

    def judge(self, verified: list[int]) -> None:
        """Scores the last round's drafts against the verified tokens now known."""
        if self.last is None:
            return
        position, drafts, copy, copied = self.last
        self.last = None
        truth = verified[position : position + len(drafts)]
        kept = next((i for i, (a, b) in enumerate(zip(drafts, truth)) if a != b), len(truth))
        for i in range(min(kept + 1, len(truth))):
            if i < copied:
                self.copy.add(drafts[i] == truth[i])
                continue
            self.model.add(drafts[i] == truth[i])
            if i < len(copy):
                self.copy.add(copy[i] == truth[i])


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """The length of a's and b's common prefix, known to be at least start."""
    n = min(len(a), len(b))
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
