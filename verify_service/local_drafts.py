"""Colocated drafting: the verifier drafts for a session itself, so that a speculative Decode
runs round after round without leaving the service, no call per round and no hop between
the draft and the verify.

The drafter is specserve's (the draft service runs the same one): its draft model, the
target's own first layers (early exit) or n-gram lookup (always served: it needs no model).
With Medusa heads loaded, method medusa drafts from the target's own hidden state
(specserve/methods/medusa_drafts.py); on the runner backend, method lookahead from the target's
own guesses in a Jacobi window fed beside the round's candidates (specserve/methods/lookahead.py).
Each session keeps its draft state and its KChooser, which picks each round's K from the
session's measured costs and acceptance. Everything runs on the verifier's worker thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from specserve.adaptive import Batch, KChooser, RoundChoice, Shared
from specserve.batch_choice import BatchChoice
from specserve.drafting import Drafter, DraftJob, DraftSession, Proposal
from specserve.errors import RequestError
from specserve.grammar import GrammarState
from specserve.logit_processing import NEUTRAL
from specserve.methods import registry
from specserve.methods.eagle_drafts import EagleDrafting, EagleState
from specserve.methods.lookahead import LookaheadSession, LookaheadShape
from specserve.methods.medusa_drafts import MedusaDrafting
from specserve.pacing import MethodRate, Pacing
from specserve.serving.logs import RateLimitedLog
from specserve.speculation import Speculation

log = logging.getLogger(__name__)


@dataclass
class SessionDrafts:
    """A verifier session's colocated drafting: its draft state and its choice of K."""

    speculation: Speculation
    draft: DraftSession | None  # None for the verifier's own methods: medusa, eagle, lookahead
    chooser: KChooser
    lookahead: LookaheadSession | None = None
    eagle: EagleState | None = None  # an EAGLE head's entries of the session
    drafted_rounds: int = 0
    last_k: int = 0  # the K of the round before
    tree_round: bool = False  # whether the round drafted now is a tree
    prompt_length: int = 0  # the session's tokens that are its prompt (logits processing counts the rest)
    pacing: Pacing | None = None  # lookahead's: its rounds or target-only ones
    paced_round: bool = False  # whether the round drafted now is lookahead's
    grammar: GrammarState | None = None  # the session's (structured outputs): the drafts' q are masked by it

    def observe(self, outcome, round_s: float) -> None:
        """Feeds a round's Outcome to the chooser: its drafting, its verify (forward and
        decision) and all it took (round_s). A drafting that fed the draft more than a round's
        tokens is no round's usual cost and is left out: the first (it reads the prompt), and
        the first after target-only rounds (it reads what they made; counted, it made drafts
        look dear, which made the target-only stretches, and so the next catch-up, longer).
        A lookahead round's verify feeds its window too, no round of K drafts: its costs would
        mislead the K of every session, and lookahead rounds are not chosen by them but paced
        (specserve/pacing.py)."""
        if self.lookahead is not None:
            verify_s = (outcome.decided_ns - outcome.batch_started_ns) / 1e9
            self.pacing.observe(self.paced_round, outcome.num_accepted + 1, round_s, verify_s)
            return
        verify_s = (outcome.decided_ns - outcome.batch_started_ns) / 1e9
        draft_s = outcome.draft_seconds if self.drafted_last_round else None
        self.drafted_rounds += outcome.num_draft_tokens > 0
        self.last_k = outcome.num_draft_tokens
        tree = self.tree_round and outcome.num_draft_tokens > 0
        self.chooser.observe(
            outcome.num_draft_tokens, outcome.num_accepted, draft_s, verify_s, round_s, tree, batch_of(outcome)
        )

    @property
    def drafted_last_round(self) -> bool:
        """Whether the session drafted in its last round (and so its drafts read only what that
        round made): not its first drafting, nor the first after target-only rounds."""
        return bool(self.drafted_rounds and self.last_k > 0)

    @property
    def catches_up(self) -> bool:
        """Whether the session's next drafts first read more than its last round made: a
        draft model's first (the prompt) or first after target-only rounds (what they made)."""
        return not self.drafted_last_round and registry.spec_of(self.speculation.method).model

    def unread(self, length: int) -> int:
        """The tokens of a sequence `length` long that the session's draft model has not read
        (0 where it drafts with none)."""
        return length - len(self.draft.verified) if self.draft is not None else 0

    def next_round(self, remaining: int, sessions: int = 1) -> RoundChoice:
        """The round for a session that may make `remaining` more tokens, in a batch of
        `sessions`: the chooser's, or for lookahead candidates of N - 1 tokens (fewer near
        the end), every round."""
        if self.lookahead is None:
            return self.chooser.next_round(remaining, sessions)
        # Adaptive, lookahead rounds alternate with target-only ones where they do not pay.
        paced = self.speculation.adaptive and not self.pacing.speculate()
        k = 0 if paced else min(self.lookahead.shape.ngram - 1, max(0, remaining - 1))
        self.paced_round = k > 0
        return RoundChoice(k)


def batch_of(outcome) -> Batch | None:
    """The batch an Outcome's round ran in (None where the verifier did not say)."""
    if not outcome.batch_sessions:
        return None
    return Batch(
        outcome.batch_sessions,
        outcome.batch_tokens,
        outcome.batch_draft_tokens,
        outcome.batch_prefill,
        outcome.batch_started_ns,
        outcome.batch_caught_up,
        outcome.batch_draft_ns / 1e9,
    )


@dataclass(frozen=True)
class LocalProposal:
    """One session's drafts for this round (none: a target-only round)."""

    draft_token_ids: tuple[int, ...] = ()
    draft_distributions: tuple = ()
    draft_parents: tuple[int, ...] = ()  # a token tree's; () a chain
    window_nodes: int = 0  # a lookahead round's last nodes: its window, which no decision reads


@dataclass
class DraftTiming:
    """When the batch's drafting ran (time.time_ns), shared by its rows, and whether a draft
    model first read more than a round made for one of them (SessionDrafts.catches_up)."""

    started_ns: int = 0
    ended_ns: int = 0
    caught_up: bool = False

    def fields(self) -> dict:
        """As the Outcome fields of a row it drafted for."""
        return {"draft_started_ns": self.started_ns, "draft_ended_ns": self.ended_ns, "batch_caught_up": self.caught_up}


class LocalDrafting:
    def __init__(
        self,
        drafter: Drafter,
        max_speculative_tokens: int,
        medusa: MedusaDrafting | None = None,
        lookahead: LookaheadShape | None = None,
        lookahead_every_round: bool = True,
        eagle: EagleDrafting | None = None,
    ):
        """lookahead: the shape lookahead sessions take where a request sets none (None: the
        method is not served, as on the transformers backend, which has no token trees);
        lookahead_every_round: whether every round feeds the window, or only uncopied ones."""
        self.drafter = drafter
        self.medusa = medusa
        self.eagle = eagle
        self.lookahead = lookahead
        self.lookahead_every_round = lookahead_every_round
        self.max_speculative_tokens = max_speculative_tokens
        self._failures = RateLimitedLog(log)
        self.shared = Shared()  # what the sessions learn together: round costs, acceptance
        self.batch_choice = BatchChoice()  # under load: one K for the sessions that draft alike
        self.method_rates: dict[str, MethodRate] = {}  # paced methods' tokens per second (lookahead's)
        vocab = drafter.options.vocab_size
        self._larger_vocabulary = any(m.vocab_size > vocab for m in drafter.models.values())

    @property
    def methods(self) -> tuple[str, ...]:
        own = tuple(
            name
            for name, served in (("medusa", self.medusa), ("eagle", self.eagle), ("lookahead", self.lookahead))
            if served
        )
        return (*self.drafter.methods, *own)

    def session_drafts(
        self, current: SessionDrafts | None, speculation: Speculation, prompt_length: int = 0, sampled: bool = False
    ) -> SessionDrafts:
        """The session's drafting for these settings: the current one, or a new one when the
        settings changed (the old one closed once the new one is open). prompt_length: the
        session's tokens that are its prompt (the drafts' logits processing counts the rest);
        sampled: whether it samples (its K is chosen from sampled sessions' measures)."""
        if current is not None and current.speculation == speculation and current.chooser.sampled == sampled:
            return current
        model = registry.spec_of(speculation.method).model  # its drafts first read what the target made
        chooser = KChooser(speculation, self.shared, self.max_speculative_tokens, sampled, cheap_probes=not model)
        # The verifier's own methods draft from the target's state; the others are the drafter's.
        opened = {"lookahead": self._open_lookahead, "medusa": self._open_medusa, "eagle": self._open_eagle}.get(
            speculation.method, self._open_drafter
        )(speculation, chooser, prompt_length)  # raises for a method not served, or when full
        self.close(current)  # once the new one is open
        return opened

    def _open_drafter(self, speculation: Speculation, chooser: KChooser, prompt_length: int) -> SessionDrafts:
        draft = self.drafter.open_session(
            "", speculation.method, speculation.tenant, speculation.isolated, prompt_length
        )
        return SessionDrafts(speculation, draft, chooser, prompt_length=prompt_length)

    def _open_medusa(self, speculation: Speculation, chooser: KChooser, prompt_length: int) -> SessionDrafts:
        return SessionDrafts(speculation, None, chooser, prompt_length=prompt_length)  # the heads keep no state

    def _open_eagle(self, speculation: Speculation, chooser: KChooser, prompt_length: int) -> SessionDrafts:
        return SessionDrafts(speculation, None, chooser, prompt_length=prompt_length, eagle=EagleState())

    def _open_lookahead(self, speculation: Speculation, chooser: KChooser, prompt_length: int) -> SessionDrafts:
        shape = self.lookahead.with_settings(speculation.lookahead)  # raises for a bad setting
        session = LookaheadSession(shape, self.drafter.options.ngram_max, self.lookahead_every_round)
        pacing = Pacing(chooser.costs, self.method_rates.setdefault("lookahead", MethodRate()))
        return SessionDrafts(speculation, None, chooser, session, prompt_length=prompt_length, pacing=pacing)

    def next_rounds(
        self, rooms: list[tuple[SessionDrafts, int]], sessions: int, lengths: list[int] | None = None
    ) -> list[RoundChoice]:
        """The round of each (session drafts, tokens it may still make) of a batch of `sessions`
        sessions, whose sequences are `lengths` long (None: their drafts have nothing to read
        first): in a batch of more than one, the adaptive chains of one method and kind draft
        one K (specserve/batch_choice.py); trees, lookahead, fixed Ks and a session alone
        choose their own."""
        choices: list[RoundChoice | None] = [None] * len(rooms)
        groups: dict[str, list[int]] = {}
        for i, (drafts, remaining) in enumerate(rooms):
            spec = drafts.speculation
            if sessions > 1 and spec.adaptive and spec.tree is None and drafts.lookahead is None:
                groups.setdefault(drafts.chooser.method, []).append(i)
            else:
                choices[i] = drafts.next_round(remaining, sessions)
        for members in groups.values():
            choosers = [rooms[i][0].chooser for i in members]
            unread = [rooms[i][0].unread(lengths[i]) for i in members] if lengths else None
            ks = self.batch_choice.choose(choosers, [rooms[i][1] for i in members], sessions, unread)
            for i, k in zip(members, ks):
                choices[i] = RoundChoice(k)
        return choices

    def observe_target_only(self, outcome, round_s: float, sampled: bool) -> None:
        """A target-only decode's token: what a round without drafts costs (sampled: a
        sampled session's)."""
        verify_s = (outcome.decided_ns - outcome.batch_started_ns) / 1e9
        self.shared.costs_for(sampled).observe("none", 0, None, verify_s, round_s, batch_of(outcome))

    def close(self, drafts: SessionDrafts | None, tokens: list[int] | None = None) -> None:
        """tokens: the session's whole sequence, its last round's tokens too (method suffix
        shares them with later requests)."""
        if drafts is not None and drafts.draft is not None:
            if tokens is not None:
                drafts.draft.verified = list(tokens)
            self.drafter.close_session(drafts.draft)

    def propose(
        self, jobs: list[tuple[SessionDrafts, list[int], RoundChoice, object, object]]
    ) -> tuple[list[LocalProposal], DraftTiming]:
        """Drafts for (session drafts, verified tokens, round's choice, sampling, the hidden
        state of the session's last token's logits) of every row at once; a row whose drafting
        fails runs target-only this round."""
        timing = DraftTiming(started_ns=time.time_ns())
        wanted = [i for i, (drafts, _, choice, _, _) in enumerate(jobs) if choice.k > 0 and drafts.draft is not None]
        timing.caught_up = any(jobs[i][0].catches_up for i in wanted)
        heads = [
            i
            for i, (drafts, _, choice, _, _) in enumerate(jobs)
            if choice.k > 0 and drafts.speculation.method == "medusa"
        ]
        out = [LocalProposal()] * len(jobs)
        for i, (drafts, verified, choice, sampling, _) in enumerate(jobs):
            if choice.k > 0 and drafts.lookahead is not None:
                self._lookahead(out, i, drafts.lookahead, verified, choice.k, sampling.is_greedy)
        if heads:
            self._medusa(jobs, heads, out)
        guessed = [i for i, (drafts, _, choice, _, _) in enumerate(jobs) if choice.k > 0 and drafts.eagle is not None]
        if guessed:
            self._eagle(jobs, guessed, out)
        if wanted:
            for i, proposal in zip(wanted, self._step([self._job(*jobs[i][:4]) for i in wanted])):
                if isinstance(proposal, Proposal):
                    out[i] = self._in_vocabulary(proposal)
                elif not isinstance(proposal, RequestError):  # a request error: a sequence it cannot draft for
                    self._failures.warning("colocated drafting failed (%s); the round runs target-only", proposal)
        timing.ended_ns = time.time_ns()
        return out, timing

    def _lookahead(self, out: list, i: int, session: LookaheadSession, verified: list[int], k: int, greedy: bool):
        room = self.drafter.options.max_context_length - len(verified)
        try:
            out[i] = LocalProposal(*session.propose(verified, k, greedy, room))
        except Exception as error:  # noqa: BLE001 - drafts are optional: the round runs target-only
            self._failures.warning("lookahead drafting failed (%s); the round runs target-only", error)

    def _medusa(self, jobs: list, rows: list[int], out: list[LocalProposal]) -> None:
        asked, process = [], []
        for i in rows:
            drafts, verified, choice, sampling, hidden = jobs[i]
            processing = sampling.processing if self.drafter.options.process_logits else NEUTRAL
            shaped = processing.active or drafts.grammar is not None
            drafts.tree_round = choice.tree is not None and sampling.is_greedy and not shaped
            asked.append((verified, hidden, choice.k, choice.tree, sampling.is_greedy))
            eos = self.medusa.eos_token_ids
            after = processing.after(verified, drafts.prompt_length, eos) if processing.active else None
            process.append(with_grammar(after, drafts.grammar) if drafts.grammar is not None else after)
        try:
            proposals = self.medusa.propose(asked, process)
        except Exception as error:  # noqa: BLE001 - drafts are optional: the rounds run target-only
            self._failures.warning("Medusa drafting failed (%s); the round runs target-only", error)
            return
        for i, proposal in zip(rows, proposals):
            out[i] = LocalProposal(*proposal)

    def _eagle(self, jobs: list, rows: list[int], out: list[LocalProposal]) -> None:
        asked = [(jobs[i][0].eagle, jobs[i][1], jobs[i][2].k, jobs[i][3]) for i in rows]
        try:
            proposals = self.eagle.propose(asked)
        except Exception as error:  # noqa: BLE001 - drafts are optional: the rounds run target-only
            self._failures.warning("EAGLE drafting failed (%s); the round runs target-only", error)
            for state, *_ in asked:  # its entries may be half read: they start again
                state.reset()
            return
        for i, (drafts, distributions) in zip(rows, proposals):
            out[i] = LocalProposal(drafts, distributions)

    def _in_vocabulary(self, proposal: Proposal) -> LocalProposal:
        """The proposal up to its first position that reaches past the target's vocabulary (a
        draft may pad its output layer to more ids than the target's)."""
        ids, distributions = proposal.draft_token_ids, proposal.draft_distributions
        if proposal.draft_parents:  # a tree is kept whole or not at all: dropping nodes by their tokens is not exact
            if self._larger_vocabulary and any(
                token >= self.drafter.options.vocab_size
                or (distributions and max(d.token_ids) >= self.drafter.options.vocab_size)
                for token, d in zip(ids, distributions or [None] * len(ids))
            ):
                return LocalProposal()
            return LocalProposal(ids, distributions, proposal.draft_parents)
        if self._larger_vocabulary:
            vocab = self.drafter.options.vocab_size
            outside = [
                i
                for i, token in enumerate(ids)
                if token >= vocab or (distributions and max(distributions[i].token_ids) >= vocab)
            ]
            keep = outside[0] if outside else len(ids)
            ids, distributions = ids[:keep], distributions[:keep]
        return LocalProposal(ids, distributions)

    def _job(self, drafts: SessionDrafts, verified: list[int], choice: RoundChoice, sampling) -> DraftJob:
        known = len(drafts.draft.verified)  # a prefix of verified: the session only grows
        drafts.tree_round = choice.tree is not None
        return DraftJob(
            drafts.draft,
            tuple(verified[known:]),
            len(verified),
            choice.k,
            sampling,
            drafts.speculation.min_draft_probability,
            tree=choice.tree,
            grammar=drafts.grammar,
        )

    def _step(self, jobs: list[DraftJob]) -> list:
        """Each job's Proposal or error; a failure of the drafting itself (the drafter has
        reset the caches it touched) fails every job, never the verifier's batch. The target's
        torch threads draft too: setting another count per round would clear oneDNN's cache of
        kernels and fail the compiled steps' guards (a recompile)."""
        try:
            return self.drafter.step(jobs)
        except Exception as error:  # noqa: BLE001 - drafts are optional: the rounds run target-only
            return [error] * len(jobs)


def with_grammar(after, grammar: GrammarState):
    """A drafter's shaping of its logits (logits [vocab], added) -> logits: after's, then
    the grammar's mask after the round's drafts before the position."""

    def shaped(logits, added):
        logits = after(logits, added) if after is not None else logits
        return grammar.masked(logits[None], [list(added)])[0]

    return shaped
