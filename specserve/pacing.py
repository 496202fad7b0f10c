"""Whether a method whose rounds no K describes pays, per session: lookahead feeds its Jacobi
window to every round's forward beside the candidates, so its cost is not that of K draft
tokens, and the adaptive K chooser (specserve/speculation.py) cannot weigh it. Where a
target's extra rows are dear (a CPU, 4-bit matrices whose product reads the matrix once for
up to four rows), such a round can cost several target-only ones and keep too few tokens
to make up for it.

A Pacing compares the tokens per second of the session's own rounds of its method with a
target-only round's (the process's measured one-token round) and, where the method's are
fewer, runs target-only stretches, doubling while it does not pay, with a few rounds of the
method between them to measure again, as the K chooser does for drafts. A new session
starts from what the method's earlier sessions measured, and from their stretch, so it
does not pay again to learn what they learnt. Which tokens come out is never at stake: a target-only round is exact too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.adaptive import PROBE_STRETCH, RoundCosts

# Rounds of the method before its rate is judged (a lookahead window needs a few to fill), and
# how many measured rounds a new session's prior counts as.
PROBE_ROUNDS, PRIOR_ROUNDS = 3, 4
MEASURE_ROUNDS = 2  # target-only rounds run to measure one, where no session has yet
DECAY = 0.8  # a round's weight in the session's running rate fades by this with each later one


@dataclass
class MethodRate:
    """Decayed sums of a method's rounds' tokens and seconds (its tokens per second), and the
    length of its next target-only stretch, which its sessions share: a new session that the
    method does not pay for waits as long as the last one found it should."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0
    stretch: int = PROBE_STRETCH[0]

    def add(self, tokens: int, seconds: float, decay: float = DECAY) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.rounds = decay * self.rounds + 1

    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def prior(self, rounds: float) -> MethodRate:
        """This rate, counted as `rounds` rounds."""
        if self.rounds <= 0:
            return MethodRate()
        scale = rounds / self.rounds
        return MethodRate(self.tokens * scale, self.seconds * scale, rounds, self.stretch)


@dataclass
class Pacing:
    """One session's choice, round by round, between its method and target-only (see the
    module docstring). costs: the process's round costs (a target-only round's); method: the
    method's rate over all sessions, which this one's rounds add to."""

    costs: RoundCosts
    method: MethodRate
    own: MethodRate = field(default_factory=MethodRate)
    probe_rounds: int = 0  # the method's rounds since the last target-only stretch
    target_only_left: int = 0

    def __post_init__(self) -> None:
        self.own = self.method.prior(PRIOR_ROUNDS)
        if self._pays() is False:  # the method's earlier sessions found it does not pay: wait as they do
            self.target_only_left = self.method.stretch

    def speculate(self) -> bool:
        """Whether the next round is the method's; False: a target-only one."""
        return self.target_only_left == 0

    def observe(self, speculated: bool, tokens: int, round_s: float, verify_s: float) -> None:
        """A round: the method's (speculated) or target-only, the tokens it made, all it took
        (round_s) and its forward and decision (verify_s)."""
        if not speculated:
            self.costs.observe("none", 0, None, verify_s, round_s)
            self.target_only_left = max(0, self.target_only_left - 1)
            return
        self.own.add(tokens, round_s)
        self.method.add(tokens, round_s)
        self.probe_rounds += 1
        if self.probe_rounds < PROBE_ROUNDS:
            return
        pays = self._pays()
        if pays is None:  # a target-only round's cost is not measured yet: a couple to measure it
            self.target_only_left, self.probe_rounds = MEASURE_ROUNDS, 0
        elif pays:
            self.method.stretch = PROBE_STRETCH[0]
        else:
            self._stretch_out()

    def _pays(self) -> bool | None:
        """Whether the method's rounds make more tokens per second than target-only ones;
        None until both are measured."""
        plain = self.costs.round_seconds("none", 0)
        rate = self.own.rate()
        if plain is None or rate is None:
            return None
        return rate >= 1 / plain

    def _stretch_out(self) -> None:
        self.target_only_left = self.method.stretch
        self.method.stretch = min(2 * self.method.stretch, PROBE_STRETCH[1])
        self.probe_rounds = 0
