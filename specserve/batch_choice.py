"""Under load, one K for the sessions of a batch that draft alike.

A session alone picks its own K (specserve/adaptive.py, KChooser). In a batch the drafting is
one pass for all its rows: a draft model's K steps cost about as much for one row as for
every row, while each row adds to the verify and the rest. Sessions that chose apart left
batches of mixed Ks: one session's try of drafts, or its K where the others' was 0, paid a
whole drafting pass for one row, though each had chosen by a batch whose sessions all drafted
alike. Measured on the demo pair with 16 greedy clients: adaptive requests drafted in 28-53%
of rounds and ran 0.97-1.04x target-only, where every session drafting K = 4 ran 1.21x.

So in a batch of more than one session, the adaptive sessions of one method and kind
(greedy or sampled; KChooser.method) draft one K: the one with the most expected tokens per
second of the batch, from the mean of their expected tokens, by the costs and the margin
for drafts a session alone is chosen by (adaptive.fastest_k). They stop and
try again together: after a batch that chose K = 0, the group's batches run target-only for
a stretch that doubles (4 to 64 batches) while drafts keep not paying, then one batch drafts
(at least 1 each) to measure again; all its sessions' acceptance is measured by that one
pass. A draft model's try is dear in a batch: it first reads every session's tokens since
its last drafting, new sessions' whole prompts (at 16 sampled clients such batches averaged
1.6 ms of every round's drafting while 2% of rounds drafted: a try every 64 batches cost
the default request about 8% of its round); its stretch doubles up to 256 batches, and its
try is two batches, the second a usual round's drafting, which gives the drafting cost its
point (a catch-up gives none: tried in one batch, the cost of drafts was never measured
again, and a batch that stopped drafting on a misread cost never drafted again). After a
stretch of PARTIAL_AFTER batches or more, such a try drafts only for the sessions with the
fewest tokens to read, up to TRY_READ tokens of them (at least one session): every session
read its context at 16 sampled clients, about 4,800 tokens, 40 ms a try. Their acceptance
feeds their method's, which every session's starts from, and once drafts pay, all draft.
After a shorter stretch all try: the reading is short, and tries of one session measured
too little (at 16 greedy clients, where drafts pay on and off, they left the group
target-only twice as often). Each batch whose drafts pay halves the next stretch: restarted
at 4 by one lucky try, the stretch led to tries that each read everything again. Each
session's K is then cut to its bounds and to what it may still make.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.adaptive import PROBE_STRETCH, KChooser, fastest_k

DEAR_STRETCH = 256  # the longest stretch of a method whose try of drafts first catches up
TRY_READ = 256  # the tokens a try of such drafts may first read, over the sessions it drafts for
PARTIAL_AFTER = 64  # ... once it follows this many target-only batches (before, all sessions try)


@dataclass
class _Group:
    """A method and kind's batch stretch: target-only batches left, batches of a try of drafts
    left, and the next stretch."""

    probe_in: int = 0
    tries: int = 0
    stretch: int = PROBE_STRETCH[0]
    stopped: int = 0  # the target-only batches of the stretch before the try


class BatchChoice:
    """The K of each batch's adaptive sessions of one method and kind (module docstring); its
    state is the process's, one per KChooser.method."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}

    def choose(
        self, choosers: list[KChooser], rooms: list[int], sessions: int, unread: list[int] | None = None
    ) -> list[int]:
        """Each chooser's K this batch: choosers all of one method, their sessions' remaining
        tokens, the batch's sessions (all of its rows, these and others), and the tokens each
        session's drafts must first read (None: none)."""
        group = self.groups.setdefault(choosers[0].method, _Group())
        cheap = choosers[0].cheap_probes
        for chooser in choosers:
            chooser.sessions = sessions
        if group.probe_in > 0:
            group.probe_in -= 1
            if group.probe_in == 0:  # a try of drafts next: where its first catches up, a second measures
                group.tries = 1 if cheap else 2
            return [self._cut(chooser, 0, room) for chooser, room in zip(choosers, rooms)]
        everyone = set(range(len(choosers)))
        if group.tries > 0:
            group.tries -= 1
            k = self._best(choosers, rooms, sessions, lowest=1)
            partial = not cheap and unread and group.stopped >= PARTIAL_AFTER
            drafting = self._tried(unread) if partial else everyone
        else:
            k, drafting = self._best(choosers, rooms, sessions, lowest=0), everyone
            if k == 0:
                group.probe_in = group.stopped = group.stretch
                group.stretch = min(2 * group.stretch, PROBE_STRETCH[1] if cheap else DEAR_STRETCH)
            else:  # drafts pay: each such batch halves the next stretch (one lucky try does not restart it)
                group.stretch = max(PROBE_STRETCH[0], group.stretch // 2)
        return [self._cut(c, k if i in drafting else 0, room) for i, (c, room) in enumerate(zip(choosers, rooms))]

    @staticmethod
    def _tried(unread: list[int]) -> set[int]:
        """The sessions a dear try drafts for: those with the fewest tokens to read first, up to
        TRY_READ of them in all, and at least one."""
        tried, read = set(), 0
        for i in sorted(range(len(unread)), key=unread.__getitem__):
            if tried and read + unread[i] > TRY_READ:
                break
            tried.add(i)
            read += unread[i]
        return tried

    @staticmethod
    def _cut(chooser: KChooser, k: int, room: int) -> int:
        return max(0, min(max(k, chooser.low), chooser.high, room - 1))

    @staticmethod
    def _best(choosers: list[KChooser], rooms: list[int], sessions: int, lowest: int) -> int:
        """The K (at least lowest) with the most expected tokens per second of the batch, were
        each of its sessions to draft it and keep what these keep on average; until the costs
        it needs are measured, the speculation's K."""
        lead = choosers[0]
        high = max(0, *(min(chooser.high, room - 1) for chooser, room in zip(choosers, rooms)))
        low = min(max(lowest, min(chooser.low for chooser in choosers)), max(0, high))
        each = [chooser.acceptance.expected_up_to(high) for chooser in choosers]
        mean = [sum(column) / len(choosers) for column in zip(*each)]
        best = fastest_k(lead.costs, lead.method, sessions, mean, low)
        return max(low, min(lead.start, high)) if best is None else best
