"""Lookahead decoding (Fu et al. 2024, https://arxiv.org/abs/2402.02057): the target drafts
for itself, with no draft model and nothing trained. A session keeps a Jacobi window and a
pool of n-grams; each round's one forward carries both (docs/design.md, "Lookahead decoding").

The window is N - 1 levels of W guesses, each level one Jacobi iteration. The forward feeds
it as a token tree: level 0 is a chain from the last verified token (its column c at offset
c + 1), and level l's column c is the child of level l - 1's. So node (l, c) sees level 0 up
to column c and its own column below it: a chain of c + l + 1 tokens, the diagonal the
paper's attention mask gives. The target's argmax at the top level's column c guesses the
token after that chain, and the column read upwards plus that guess is an n-gram the pool
keeps, keyed by its first token. The window then drops level 0 and takes the guesses as its
new top level (one Jacobi step; until N - 1 levels exist it only grows).

Beside the window, the same forward verifies up to G candidates of N - 1 tokens that follow
the last verified token: first a copy of the context where that token occurred before (the
ngram method's lookup, which the paper's implementation also takes from the prompt), then
the pool's n-grams that start with it, the newest first. The candidates share prefixes as a
tree; the window's nodes are verified by nothing (the decision reads the candidates' nodes
only) and leave no cache. Every candidate is a function of the session's own tokens and
the target's argmax, so its q is one-hot; a sampled round verifies the first candidate only,
a chain, by the rule that accepts a one-hot draft with probability p(x), which is exact.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from specserve.errors import require
from specserve.methods.ngram import ngram_drafts, one_hot

# Tuned on the demo pair on a CPU (docs/benchmarks.md, twelfth section), where each token a
# forward feeds costs about 6% of a target step: a small window. The paper's GPU runs take
# W = 15, N = 5, G = 15 for a 7B model, where the forward has compute to spare.
DEFAULT_WINDOW, DEFAULT_NGRAM, DEFAULT_GUESSES = 3, 5, 2
MAX_WINDOW, MAX_NGRAM, MAX_GUESSES = 16, 8, 8
MAX_NODES = 64  # fed per round beside the root: (W + G) * (N - 1)
MAX_POOL = 4096  # n-grams a session's pool keeps; the least recently made go first


@dataclass(frozen=True)
class LookaheadShape:
    """W (window), N (ngram: the pool's n-grams, a candidate being its last N - 1 tokens) and
    G (guesses: candidates verified per round)."""

    window: int = DEFAULT_WINDOW
    ngram: int = DEFAULT_NGRAM
    guesses: int = DEFAULT_GUESSES

    def __post_init__(self) -> None:
        require(1 <= self.window <= MAX_WINDOW, f"lookahead window must lie in 1..{MAX_WINDOW}, got {self.window}")
        require(2 <= self.ngram <= MAX_NGRAM, f"lookahead ngram must lie in 2..{MAX_NGRAM}, got {self.ngram}")
        require(1 <= self.guesses <= MAX_GUESSES, f"lookahead guesses must lie in 1..{MAX_GUESSES}, got {self.guesses}")
        require(
            self.nodes <= MAX_NODES,
            f"a lookahead round of (window {self.window} + guesses {self.guesses}) x (ngram {self.ngram} - 1) "
            f"= {self.nodes} nodes passes the most, {MAX_NODES}",
        )

    @property
    def nodes(self) -> int:
        """The most nodes a round feeds beside its root: the window's and the candidates'."""
        return (self.window + self.guesses) * (self.ngram - 1)

    def with_settings(self, settings: tuple[int, int, int]) -> LookaheadShape:
        """A request's (W, N, G) over this shape: its 0s (unset) are this shape's; a setting out
        of its range raises InvalidArgument."""
        window, ngram, guesses = (asked or own for asked, own in zip(settings, (self.window, self.ngram, self.guesses)))
        return LookaheadShape(window, ngram, guesses)


class LookaheadSession:
    """One session's window and n-gram pool; only the verifier's worker thread touches it."""

    def __init__(self, shape: LookaheadShape, ngram_max: int = 4, every_round: bool = True):
        """every_round: feed the window every round (the paper's); False: only in rounds with no
        copy of the context to verify, where its n-grams are all there is (a CPU's forward
        costs per token fed, and the copy holds far more often than the pool's n-grams)."""
        self.shape = shape
        self.every_round = every_round
        self.ngram_max = ngram_max  # the context copy's longest suffix looked up
        self.levels: list[list[int]] = []  # the window, oldest level first
        self.pool: OrderedDict[tuple[int, ...], None] = OrderedDict()  # n-grams, least recently made first
        self.following: dict[int, OrderedDict[tuple[int, ...], None]] = {}  # first token -> the rest
        self._fed: tuple[int, int] | None = None  # the last round's window: (levels, columns) fed

    def propose(self, verified: list[int], depth: int, greedy: bool, room: int) -> tuple:
        """The round after verified: (its nodes' tokens, the candidates' q, the nodes' parents
        with 0 the root, () for a chain, how many of the nodes are the window's, which come
        last). Candidates have at most depth tokens; the window is fed in the rounds the
        session's policy feeds it, where room (positions left in the context after the last
        token) holds it. A round that does not feed the window verifies the copy alone, a chain."""
        if not self.levels:
            self._start(verified)
        copy = tuple(ngram_drafts(verified, depth, self.ngram_max)) if depth > 0 else ()
        levels, columns = len(self.levels), self.shape.window
        fed = (self.every_round or not copy) and columns + levels - 1 <= room  # (l, c) at offset c + l + 1
        candidates = self._candidates(verified[-1], copy, depth) if fed and depth > 0 else [copy] if copy else []
        if not greedy:
            candidates = candidates[:1]
        drafts, parents = _trie(candidates)
        q = () if greedy else tuple(one_hot(drafts))
        self._fed = (levels, columns) if fed else None
        if not fed:
            return tuple(drafts), q, (), 0
        base = len(drafts)  # node numbers: the root 0, the candidates', then the window's
        for c in range(columns):
            for level in range(levels):
                drafts.append(self.levels[level][c])
                parents.append(len(drafts) - 1 if level else 0 if c == 0 else base + 1 + (c - 1) * levels)
        return tuple(drafts), q, tuple(parents), levels * columns

    def learn(self, window_argmax: list[int] | None) -> None:
        """The target's argmax at the window's nodes, in the order propose gave them (None: the
        window was not fed whole): collects the n-grams and moves the window one step."""
        fed, self._fed = self._fed, None
        if fed is None or window_argmax is None:
            return
        levels, columns = fed
        top = [window_argmax[c * levels + levels - 1] for c in range(columns)]
        if levels == self.shape.ngram - 1:
            for c in range(columns):
                self._add(tuple(level[c] for level in self.levels) + (top[c],))
            self.levels.pop(0)
        self.levels.append(top)

    def _start(self, verified: list[int]) -> None:
        """The first level: tokens of the context, drawn by a generator seeded by it (a session's
        drafts depend on its own tokens only)."""
        draw = random.Random(len(verified) * 1_000_003 + verified[-1])
        self.levels = [[draw.choice(verified) for _ in range(self.shape.window)]]

    def _candidates(self, last: int, copy: tuple[int, ...], depth: int) -> list[tuple[int, ...]]:
        candidates = [copy] if copy else []
        for rest in reversed(self.following.get(last, {})):
            guess = rest[:depth]
            if len(candidates) >= self.shape.guesses:
                break
            if guess not in candidates:
                candidates.append(guess)
        return candidates[: self.shape.guesses]

    def _add(self, ngram: tuple[int, ...]) -> None:
        self.pool.pop(ngram, None)
        self.pool[ngram] = None
        rest = self.following.setdefault(ngram[0], OrderedDict())
        rest.pop(ngram[1:], None)
        rest[ngram[1:]] = None
        while len(self.pool) > MAX_POOL:
            old, _ = self.pool.popitem(last=False)
            others = self.following[old[0]]
            others.pop(old[1:], None)
            if not others:
                del self.following[old[0]]


def _trie(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Candidates as one token tree, shared prefixes once, depth first in the candidates'
    order (so the first candidate is the first branch): (tokens, parents with 0 the root)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for candidate in candidates:
        node = 0
        for token in candidate:
            child = children.get((node, token))
            if child is None:
                tokens.append(token)
                parents.append(node)
                child = children[(node, token)] = len(tokens)
            node = child
    return tokens, parents
