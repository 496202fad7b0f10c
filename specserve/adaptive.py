"""The choice of each round's K (and of whether to draft at all) from what the sessions of a
process measure as they run.

docs/design.md's model: a round of K draft tokens costs K draft steps, a verify of K + 1
tokens and the round's overhead (decision, bookkeeping, the wire), and yields E(K) tokens.
KChooser picks each round's K, 0 (a target-only round) included, with the most expected
tokens per second, so that speculation does not make a session slower than the target alone.
The costs are RoundCosts, running estimates shared by the sessions of a process (they belong
to the models and the machine; greedy sessions' and sampled ones' apart, see Shared); how
often each draft position is accepted is the session's own, starting from its method's
average. A session that stopped drafting tries again after a stretch of target-only tokens
that doubles while drafts keep not paying; after its first, the stretch is at least the one
its method's sessions reached, and in a batch so is the first where trying drafts is dear (a
draft model must first read the session's whole prompt, and every session of the batch waits
for it). In a batch the choice weighs the batch's tokens per second (KChooser.best_k), and
in the verifier's batches the sessions that draft alike draft one K (specserve/batch_choice.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specserve.methods.trees import TreeShape
from specserve.speculation import Speculation

# Running estimates forget at these rates: costs change with the load, acceptance with the text.
DECAY, ACCEPTANCE_DECAY = 0.9, 0.95
# A session's acceptance starts as its method's average worth this many rounds; before any
# is known, a position is taken to be kept half the time.
PRIOR_WEIGHT, PRIOR_ACCEPTANCE = 10.0, 0.5
SMOOTHING = 0.5  # rounds' worth of PRIOR_ACCEPTANCE in every rate: one rejection is not a rate of 0
# Until two sizes are measured, a size's cost grows by this share of size 1's per unit: a
# verify by about a CPU's per-token attention; a round's drafting by a draft step, the first
# of which (a catch-up of the tokens just kept, weights evicted by the verify) costs double.
PRIOR_SLOPE = {"verify": 0.05, "draft": 0.5}
# Target-only tokens before drafting is tried again, doubling while drafts do not pay.
PROBE_STRETCH = (4, 64)
# Drafts are chosen only where they promise this share more tokens per second than a
# target-only round: where batches mix sizes and methods the costs are read off by about as
# much (at 4 sampled clients a target-only batch of 4 read 7% dear, one drafting 1 each 14%
# cheap), and a needless drafting delays every session of the batch (and a draft model's
# first catches up on what the target made), where a missed one forgoes a gain within the
# costs' error.
DRAFT_MARGIN = 0.1
# A size's weight in the line through the sizes grows with its samples up to this, and fades by
# this factor with each sample of any size: a size measured while slower does not bend it for good.
# It fades no lower than the floor: where only long-unmeasured sizes lie near the size asked,
# their costs are read, not a product too small for a float (the floor is far below any weight
# a size measured in the last few hundred samples has).
MAX_POINT_WEIGHT, POINT_WEIGHT_DECAY, MIN_POINT_WEIGHT = 20, 0.98, 1e-6
# A size's cost is read from a line through the sizes seen nearest it: this many on each side,
# weighted down as they lie farther than this share of the size.
NEAREST, NEAR_WIDTH, MIN_WIDTH = 4, 0.1, 2.0


class _Average:
    """An exponentially weighted mean; None until the first sample."""

    __slots__ = ("value", "decay")

    def __init__(self, decay: float = DECAY) -> None:
        self.value: float | None = None
        self.decay = decay

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


class _Line:
    """A cost that grows with a size (tokens verified, draft tokens made): a running average
    per size seen, and at a size asked, a least-squares line through the sizes seen nearest
    it, each weighted by how often it was seen and how near it lies; past the sizes seen, the
    nearest one's value and the slope of a line through all of them. Not the sizes' own
    averages: those are noisy, an unlucky size would be avoided for good, and unseen sizes
    need a value too. Not one line through all sizes: costs bend (a CPU's products are cheaper
    per row in larger batches), and a line fitted where a batch mostly runs (its sessions'
    drafts verified) misjudged the sizes it would run at otherwise (none drafted)."""

    def __init__(self, prior_slope: float):
        self.prior_slope = prior_slope  # of size 1's cost per unit, while one size is known
        self.averages: dict[int, _Average] = {}
        self.counts: dict[int, float] = {}  # each size's weight (see POINT_WEIGHT_DECAY)
        self._sizes: list[int] = []  # those seen, in order
        self._at: dict[int, float] = {}  # the values asked since the last sample
        self._slope: float | None = None  # of the line through all sizes; None: stale

    def add(self, size: int, seconds: float) -> None:
        if size not in self.averages:
            bisect.insort(self._sizes, size)
        self.averages.setdefault(size, _Average()).add(seconds)
        for n in self.counts:  # sizes not measured lately fade: their costs may be stale
            self.counts[n] = max(MIN_POINT_WEIGHT, self.counts[n] * POINT_WEIGHT_DECAY)
        self.counts[size] = min(self.counts.get(size, 0) + 1, MAX_POINT_WEIGHT)
        self._at.clear()  # fitted again when next asked
        self._slope = None

    def at(self, size: int) -> float | None:
        if not self.averages:
            return None
        value = self._at.get(size)
        if value is None:
            value = self._at[size] = self._value(size)
        return value

    def _value(self, size: int) -> float:
        low, high = self._sizes[0], self._sizes[-1]
        if self._slope is None:
            self._slope = self._fit(self._sizes)[2]
        if size < low or size > high:  # past the sizes seen: from the nearest, the overall slope
            edge = low if size < low else high
            return max(0.0, self.at(edge) + self._slope * (size - edge))
        i = bisect.bisect_left(self._sizes, size)
        mean_n, mean_v, slope = self._fit(self._sizes[max(0, i - NEAREST) : i + NEAREST], size)
        return max(0.0, mean_v + slope * (size - mean_n))

    def _fit(self, sizes: list[int], near: int | None = None) -> tuple[float, float, float]:
        """(mean size, mean cost, slope) of the weighted least-squares line through sizes, each
        weighted by its count and (near given) by how near it lies to near."""
        width = max(MIN_WIDTH, NEAR_WIDTH * near) if near is not None else float("inf")
        points = [(n, self.averages[n].value, self.counts[n] / (1 + ((n - (near or 0)) / width) ** 2)) for n in sizes]
        weight = sum(c for _, _, c in points)
        mean_n = sum(n * c for n, _, c in points) / weight
        mean_v = sum(v * c for _, v, c in points) / weight
        spread = sum(c * (n - mean_n) ** 2 for n, _, c in points)
        if len(self._sizes) > 1 and spread > 0:
            slope = max(0.0, sum(c * (n - mean_n) * (v - mean_v) for n, v, c in points) / spread)
        else:  # one size: the prior slope, relative to size 1's cost
            slope = mean_v * self.prior_slope / (1 + self.prior_slope * (mean_n - 1))
        return mean_n, mean_v, slope


@dataclass(frozen=True)
class Batch:
    """The batch a round ran in, its own row included: its sessions, the tokens its forward
    verified and the draft tokens drafted for it; prefill: a prompt was read in the same
    forward (its time is no round's); started_ns: which batch (its sessions report it one
    after another: its costs count once); caught_up: a draft model first read more than a
    round had made, for one of its sessions (a prompt, or a target-only stretch: its
    drafting is no round's usual cost); draft_s: its drafting, which every session waited for,
    counted or not (no part of the rest of a round). None for a round alone (a draft
    service's)."""

    sessions: int
    tokens: int
    draft_tokens: int
    prefill: bool = False
    started_ns: int = 0
    caught_up: bool = False
    draft_s: float = 0.0


class RoundCosts:
    """Running estimates (seconds) of round costs in one process, shared by its sessions: each
    method's drafting by the draft tokens a batch makes, a verify and the rest of a round (the
    decision, bookkeeping, the wire) by the tokens a batch verifies (each session's K + 1)."""

    def __init__(self) -> None:
        self.drafting: dict[str, _Line] = {}
        self.verify = _Line(PRIOR_SLOPE["verify"])
        self.rest = _Line(0.0)
        self._counted = (0, False)  # the last batch counted (its started_ns), and whether its drafting was

    def observe(
        self,
        method: str,
        k: int,
        draft_s: float | None,
        verify_s: float,
        round_s: float,
        batch: Batch | None = None,
    ) -> None:
        """A round of k drafts of method, in batch (None: alone); draft_s None where its
        drafting was not a round's usual work (a new session's draft reads its whole prompt
        first)."""
        batch = batch or Batch(1, k + 1, k)
        same = bool(batch.started_ns) and batch.started_ns == self._counted[0]  # its sessions report in turn
        drafting_counted = same and self._counted[1]
        if k and draft_s is not None and not drafting_counted and not batch.caught_up:
            self.drafting.setdefault(method, _Line(PRIOR_SLOPE["draft"])).add(batch.draft_tokens, draft_s)
            drafting_counted = True
        self._counted = (batch.started_ns, drafting_counted)
        if batch.prefill or same:  # a prompt's time, or a batch that another of its sessions counted
            return
        self.verify.add(batch.tokens, verify_s)
        self.rest.add(batch.tokens, max(0.0, round_s - max(draft_s or 0.0, batch.draft_s) - verify_s))

    def verify_seconds(self, tokens: int) -> float | None:
        return self.verify.at(tokens)

    def round_seconds(self, method: str, k: int, sessions: int = 1) -> float | None:
        """A round of k drafts of method (0: a target-only token) for each of a batch's
        `sessions` sessions; None until its parts are measured."""
        tokens, drafted = sessions * (k + 1), sessions * k
        verify, line = self.verify.at(tokens), self.drafting.get(method)
        if verify is None or (k and line is None):
            return None
        drafting = line.at(drafted) if k else 0.0
        return drafting + verify + (self.rest.at(tokens) or 0.0)


class Acceptance:
    """How often each draft position is kept once the ones before it were: decayed counts
    per position (0 = the first draft)."""

    def __init__(self, prior: Acceptance | None = None):
        self.reached: list[float] = []  # rounds that drafted the position with every earlier one kept
        self.kept: list[float] = []  # rounds that kept it
        if prior is not None:  # the method's average, worth PRIOR_WEIGHT rounds
            rates = [prior.rate(i) for i in range(len(prior.reached))]
            self.reached = [PRIOR_WEIGHT] * len(rates)
            self.kept = [PRIOR_WEIGHT * rate for rate in rates]

    def rate(self, position: int) -> float:
        """P(kept | every earlier draft kept); positions past the deepest one reached take its
        rate."""
        i = min(position, len(self.reached) - 1)
        if i < 0 or self.reached[i] <= 0:
            return PRIOR_ACCEPTANCE
        return (self.kept[i] + SMOOTHING * PRIOR_ACCEPTANCE) / (self.reached[i] + SMOOTHING)

    def expected_tokens(self, k: int) -> float:
        """E(K): accepted drafts plus the recovered or bonus token."""
        return self.expected_up_to(k)[k]

    def expected_up_to(self, high: int) -> list[float]:
        """E(0), E(1), ..., E(high)."""
        expected, survive = [1.0], 1.0  # and P(all of the first K kept)
        for position in range(high):
            survive *= self.rate(position)
            expected.append(expected[-1] + survive)
        return expected

    def observe(self, k: int, num_accepted: int) -> None:
        """A round of k drafts kept num_accepted: the positions it reached (up to the first
        rejected) fade and count it; the others keep what was known of them. (Fading every
        position drew those a round no longer reaches, past a short K or a rejection, to the
        prior: E(K) of a longer K fell, and a batch that drafted 1 a session never chose 2.)"""
        if k == 0:
            return
        reached = min(num_accepted + 1, k)
        while len(self.reached) < reached:
            self.reached.append(0.0)
            self.kept.append(0.0)
        for i in range(reached):
            self.reached[i] = self.reached[i] * ACCEPTANCE_DECAY + 1
            self.kept[i] = self.kept[i] * ACCEPTANCE_DECAY + (i < num_accepted)


@dataclass
class Shared:
    """What the sessions of one process learn together: the round costs, greedy sessions'
    and sampled ones' apart (a sampled decision costs more rows' softmax and draws: after
    greedy load, sampled drafts would look cheaper than they are), each method's acceptance
    (a chain's per position, a tree's as tokens per round), and each method's target-only
    stretch: a session's second stretch is at least what the method's sessions reached, so
    that under load each new session probes once, early, and not every few tokens."""

    costs: RoundCosts = field(default_factory=RoundCosts)  # greedy sessions' rounds
    sampled_costs: RoundCosts = field(default_factory=RoundCosts)
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    tree_tokens: dict[str, _Average] = field(default_factory=dict)
    stretches: dict[str, int] = field(default_factory=dict)

    def costs_for(self, sampled: bool) -> RoundCosts:
        return self.sampled_costs if sampled else self.costs

    def method_acceptance(self, method: str) -> Acceptance:
        return self.acceptance.setdefault(method, Acceptance())

    def method_tree_tokens(self, method: str) -> _Average:
        return self.tree_tokens.setdefault(method, _Average())


@dataclass(frozen=True)
class RoundChoice:
    """What a round drafts: k draft tokens as a chain, or the tree (k its nodes); k = 0: none."""

    k: int
    tree: TreeShape | None = None


def fastest_k(costs: RoundCosts, method: str, sessions: int, expected: list[float], low: int) -> int | None:
    """The K from low up to len(expected) - 1 with the most expected tokens per second of a
    batch of `sessions`, each drafting K of method and making expected[K] tokens, K = 0 weighed
    up by DRAFT_MARGIN; None until K = 0's and drafts' costs are measured."""
    if costs.round_seconds(method, 1) is None or costs.round_seconds(method, 0) is None:
        return None
    best, best_rate = low, -1.0
    for k in range(low, len(expected)):
        seconds = costs.round_seconds(method, k, sessions)
        if not seconds:
            continue
        rate = sessions * expected[k] / seconds * (1 + DRAFT_MARGIN if k == 0 else 1)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


# An adaptive session that speculates with a tree tries it again after this many chain rounds,
# and its tokens per round are the method's average worth this many rounds at first.
TREE_PROBE_ROUNDS, TREE_PRIOR_WEIGHT = 16, 4


class KChooser:
    """One session's K per round: fixed (not adaptive), or the K in its bounds with the most
    expected tokens per second under the shared costs and the session's acceptance (see the
    module docstring)."""

    def __init__(
        self,
        speculation: Speculation,
        shared: Shared | None = None,
        max_k: int | None = None,
        sampled: bool = False,
        cheap_probes: bool = True,
    ):
        """shared: what this process's sessions learn together (a fresh one for a session
        alone); max_k: the most draft tokens a round may verify (the service's limit); sampled:
        the session samples. Greedy and sampled sessions of a method learn apart: a sampled
        draft is kept less often and costs more to draw, and where drafts do not pay sampled
        they may greedy. cheap_probes: trying drafts again costs little more than a round
        (false for a draft model, which first reads what the target made meanwhile: a new
        session's whole prompt); if not, a session in a batch waits its method's stretch
        before its first try, not a short one of its own."""
        max_k = max(speculation.k_bounds[1], speculation.num_speculative_tokens) if max_k is None else max_k
        self.speculation = speculation
        self.method = f"{speculation.method}/sampled" if sampled else speculation.method  # its key in shared
        self.sampled = sampled
        self.cheap_probes = cheap_probes
        self.shared = shared or Shared()
        self.costs = self.shared.costs_for(sampled)
        self.acceptance = Acceptance(self.shared.method_acceptance(self.method))
        self.low = min(speculation.k_bounds[0], max_k)
        self.high = min(speculation.k_bounds[1], max_k)
        self.start = min(speculation.num_speculative_tokens, max_k)
        self._probe_in = 0  # target-only tokens left before drafts are tried again
        self._probe_due = False  # the stretch is over: the next round drafts
        self._at_least = 0  # after a round that kept every draft: one more than it had
        self._stretch = PROBE_STRETCH[0]
        self.tree_tokens = _Average(ACCEPTANCE_DECAY)  # a tree round's tokens, the session's own
        self._tree_rounds = 0
        self._since_tree = 0  # chain rounds since the last tree round
        self.sessions = 1  # in the batch its next round runs in (next_round's)

    def next_round(self, remaining: int, sessions: int = 1) -> RoundChoice:
        """The next round of a session that may make `remaining` more tokens, in a batch of
        `sessions` sessions: a chain of the next K, or the speculation's tree (cut to the depth
        remaining allows). Adaptive, the tree is chosen when its measured tokens per second
        beat the best chain's, and tried again every TREE_PROBE_ROUNDS chain rounds."""
        self.sessions = sessions
        tree = self.speculation.tree
        if tree is None:
            return RoundChoice(self.next_k(remaining))
        cut = tree.within_depth(max(0, remaining - 1))
        if cut is None:
            return RoundChoice(0)
        if not self.speculation.adaptive:
            return RoundChoice(len(cut), cut)
        k = self.next_k(remaining)
        if k == 0 and self._probe_in > 0:  # drafting does not pay now: a target-only stretch
            return RoundChoice(0)
        shared = self.shared.method_tree_tokens(self.method).value
        if shared is None or self._since_tree >= TREE_PROBE_ROUNDS:
            return RoundChoice(len(cut), cut)
        chain, tree_rate = self._rate(k, self.acceptance.expected_tokens(k)), self._tree_rate(cut, shared)
        if tree_rate is not None and (chain is None or tree_rate >= chain):
            return RoundChoice(len(cut), cut)
        return RoundChoice(k)

    def _rate(self, k: int, expected: float, method: str | None = None) -> float | None:
        """The batch's expected tokens per second if each of its sessions drafted k and kept
        what this one keeps: with a batch of one, the session's own."""
        seconds = self.costs.round_seconds(method or self.method, k, self.sessions)
        return self.sessions * expected / seconds if seconds else None

    def _tree_rate(self, tree: TreeShape, shared_tokens: float) -> float | None:
        """A tree round's expected tokens per second: the session's tokens per tree round,
        starting from the method's, over the tree rounds' measured cost."""
        own, rounds = self.tree_tokens.value, self._tree_rounds
        weight = min(rounds, TREE_PRIOR_WEIGHT * 4)
        if own is None:
            return self._rate(len(tree), shared_tokens, f"{self.method}/tree")
        expected = (weight * own + TREE_PRIOR_WEIGHT * shared_tokens) / (weight + TREE_PRIOR_WEIGHT)
        return self._rate(len(tree), expected, f"{self.method}/tree")

    def next_k(self, remaining: int) -> int:
        """K for the next round of a session that may make `remaining` more tokens."""
        room = max(0, remaining - 1)
        if not self.speculation.adaptive:
            return min(self.start, room)
        if self._probe_in > 0:
            return 0
        if self._probe_due:  # a round of drafts, to measure whether they pay again
            self._probe_due = False
            return self.best_k(room, lowest=1)
        best = self.best_k(room)
        if best > 0 and self._at_least > best:  # drafts pay: after all were kept, at least one more
            best = self.best_k(room, lowest=self._at_least)
        if best == 0 and room > 0:
            method_stretch = self.shared.stretches.get(self.method, PROBE_STRETCH[0])
            # The first: the session's own, to try its own text early, where that is cheap.
            dear = not self.cheap_probes and self.sessions > 1
            self._probe_in = max(self._stretch, method_stretch) if dear else self._stretch
            self._stretch = min(max(2 * self._stretch, method_stretch), PROBE_STRETCH[1])
            self.shared.stretches[self.method] = min(2 * method_stretch, PROBE_STRETCH[1])
        elif best > 0:
            self._stretch = PROBE_STRETCH[0]
            self.shared.stretches[self.method] = PROBE_STRETCH[0]
        return best

    def k_after_all_kept(self, k: int, remaining: int) -> int:
        """The K the next round would get if this one keeps all its k drafts (what a
        pipelined round drafts ahead for), without changing the choice's state."""
        if not self.speculation.adaptive:
            return min(self.start, max(0, remaining - 1))
        return self.best_k(max(0, remaining - 1), lowest=k + 1)

    @property
    def target_only_tokens(self) -> int:
        """Target-only tokens left before drafting is tried again (0: none are due)."""
        return self._probe_in

    def best_k(self, room: int, lowest: int = 0) -> int:
        """The K in bounds (and at least lowest, at most room) with the most expected tokens
        per second of the batch the round runs in, were each of its sessions to draft K (of
        the session, alone); the asked K, within them, until the costs it needs are measured.
        A batch's K pays for all its rows in the shared verify and all its drafting, against
        one pass of the weights: a K that pays alone may not under load. (Each session
        weighing only its own rows, with the others' drafting taken as paid, would keep them
        all drafting where none drafting is faster.)"""
        high = min(self.high, room)
        low = min(max(self.low, lowest), high)
        best = fastest_k(self.costs, self.method, self.sessions, self.acceptance.expected_up_to(high), low)
        return max(low, min(self.start, high)) if best is None else best  # None: costs not yet known

    def observe(
        self,
        k: int,
        num_accepted: int,
        draft_s: float | None,
        verify_s: float,
        round_s: float,
        tree: bool = False,
        batch: Batch | None = None,
    ) -> None:
        """A round of k drafts (0: target-only, one token) kept num_accepted of them; draft_s
        is its drafting (None: not a usual round's, see RoundCosts.observe), verify_s its
        verify forward and decision, round_s all it took; tree: its drafts were a tree; batch:
        the batch it ran in (None: alone)."""
        if tree:
            self.costs.observe(f"{self.method}/tree", k, draft_s, verify_s, round_s, batch)
            self.tree_tokens.add(num_accepted + 1)
            self.shared.method_tree_tokens(self.method).add(num_accepted + 1)
            self._tree_rounds += 1
            self._since_tree, self._at_least = 0, 0
            return
        self._since_tree += k > 0
        if k == 0 and self._probe_in > 0:
            self._probe_in -= 1
            self._probe_due = self._probe_in == 0
        self._at_least = k + 1 if k and num_accepted == k else 0
        self.costs.observe(self.method, k, draft_s, verify_s, round_s, batch)
        self.acceptance.observe(k, num_accepted)
        self.shared.method_acceptance(self.method).observe(k, num_accepted)
