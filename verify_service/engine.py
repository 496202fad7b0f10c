"""The verifier: scores each session's draft tokens with the target and decides, for all
sessions of a batch at once, which drafts to keep.

Vocabulary (docs/design.md, "Words"; Leviathan et al. 2023, https://arxiv.org/abs/2211.17192):
a *round* is one draft + one verify; the *draft tokens* d_1..d_K are the K proposals, drawn
from the draft distributions q_i; the target's processed distributions p_1..p_{K+1} come
from one forward over [last verified token, d_1..d_K]. *Accepted tokens* are the prefix of
drafts the rejection rule keeps; after a rejection the *recovered token* is drawn from
norm(max(0, p_j - q_j)), and when all K are kept the *bonus token* from p_{K+1}. A round
therefore emits between 1 and K+1 tokens and the output follows p exactly. *num_verified*
is the length of the verified sequence a call assumes. A decode is a run of rounds that
stays in the service, one round per batch until it is done: target-only (one token each),
or speculative with draft tokens the verifier makes itself (verify_service/local_drafts.py).

All methods run on the batcher's single worker thread, so sessions need no locks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import wait

from specserve.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, require
from specserve.logprobs import MAX_TOP_LOGPROBS
from specserve.model.backends import ForwardRow, forward_in_budget
from specserve.model.loading import LoadedModel
from specserve.protocol import check_token_ids
from specserve.serving.batching import Again
from specserve.serving.metrics import ServiceMetrics
from verify_service.config import VerifyConfig
from verify_service.decisions import decide, logprobs_of, process_logits, stop_at_end_of_sequence
from verify_service.grammar_rounds import GrammarRounds
from verify_service.jobs import (
    DecodeJob,
    Job,
    Outcome,
    PrefillJob,
    ReleaseJob,
    Row,
    Session,
    SweepJob,
    VerifyJob,
    batch_timing,
)
from verify_service.local_drafts import DraftTiming, LocalDrafting
from verify_service.scoring import score_prompt
from verify_service.tree_rounds import check_tree, check_tree_speculation, keep_path, split_window, tree_nodes

log = logging.getLogger(__name__)


class Verifier:
    def __init__(
        self,
        loaded: LoadedModel,
        config: VerifyConfig,
        metrics: ServiceMetrics | None = None,
        local: LocalDrafting | None = None,
    ):
        """local drafts for speculative decodes (colocated drafting); None: decodes run
        target-only."""
        self.loaded = loaded
        self.backend = loaded.backend
        self.config = config
        self.metrics = metrics
        self.local = local
        self.sessions: dict[str, Session] = {}
        self.grammar_rounds = GrammarRounds(config.max_speculative_tokens)  # structured outputs' share

    def step(self, jobs: list[Job]) -> list[Outcome | Again | None | BaseException]:
        """Processes one batch: one forward for every session, one kernel call per sampling
        mode; a decode with tokens still to make comes back as Again, for the next batch."""
        results: list[Outcome | Again | None | BaseException] = [None] * len(jobs)
        rows: list[tuple[int, Row]] = []
        claimed: set[str] = set()
        # Releases first: no row of a batch may run on a cache slot freed in the same batch.
        for job in jobs:
            if isinstance(job, ReleaseJob):
                self._release(job.session_id)
            elif isinstance(job, SweepJob):
                self._sweep(job.now)
        prefilled = {job.session_id for job in jobs if isinstance(job, PrefillJob)}
        released = {job.session_id for job in jobs if isinstance(job, ReleaseJob)}
        for index, job in enumerate(jobs):
            if isinstance(job, (ReleaseJob, SweepJob)):
                continue
            try:
                # A prefill beside its session's release: its caller has given up (it releases
                # only then), and a session made now would be held until the TTL.
                if isinstance(job, PrefillJob) and job.session_id in released:
                    raise FailedPrecondition(f"session {job.session_id!r} was released", 0)
                if isinstance(job, DecodeJob):
                    if job.ended.is_set():
                        continue  # its caller has gone: nothing more to make
                    self._check_decode(job, prefilled)
                require(job.session_id not in claimed, "another call for this session is in the same batch")
                rows.append((index, self._prepare(job)))
                claimed.add(job.session_id)
            except Exception as error:  # noqa: BLE001 - one bad call must not fail its batch
                if not isinstance(error, (InvalidArgument, FailedPrecondition, ResourceExhausted)):
                    log.exception("preparing %s failed", type(job).__name__)
                results[index] = error
        if not rows:
            return results
        try:
            drafted = self._draft_locally(jobs, rows)
            started = time.time_ns()
            self._forward([row for _, row in rows])
            forwarded = time.time_ns()
            decisions = decide([row for _, row in rows], self.loaded.device)
            draft_ns = drafted.ended_ns - drafted.started_ns if drafted is not None else 0
            timing = batch_timing([row for _, row in rows], started, forwarded, draft_ns)
        except BaseException:
            for _, row in rows:
                if row.is_new:
                    self.backend.close(row.session.sequence)
                elif row.is_prefill:  # its reused cache now holds half of a new prompt
                    self._release(row.session_id)
            raise
        for (index, row), (num_accepted, next_token) in zip(rows, decisions):
            row_timing = {**timing, **drafted.fields()} if row.drafted_locally else timing
            outcome = dataclasses.replace(self._commit(row, num_accepted, next_token), **row_timing)
            job = jobs[index]
            results[index] = self._decoded(job, outcome) if isinstance(job, DecodeJob) else outcome
        self._observe(len(rows), (forwarded - started) / 1e9)
        return results

    def _check_decode(self, job: DecodeJob, prefilled: set[str]) -> None:
        """A decode whose session was released or started again (a Prefill, before this
        batch or in it) stops, and its caller is told the session's length: the tokens it
        would make no longer follow the caller's sequence."""
        current = self.sessions.get(job.session_id)
        replaced = job.session is not None and current is not job.session
        if replaced or job.session_id in prefilled:
            length = len(current.tokens) if current is not None and job.session_id not in prefilled else 0
            raise FailedPrecondition(
                f"session {job.session_id!r} was released or prefilled again while decoding", length
            )

    def _decoded(self, job: DecodeJob, outcome: Outcome) -> Outcome | Again:
        """Hands a decode's round to its caller; Again while it goes on."""
        job.emit(outcome)
        session = self.sessions[job.session_id]
        self._observe_round(job, session, outcome)
        made = outcome.num_accepted + 1
        done = (
            job.ended.is_set()
            or job.max_tokens <= made
            or (
                outcome.next_token_id in self.loaded.eos_token_ids and not (job.sampling or session.sampling).ignore_eos
            )
            or outcome.num_verified >= self.loaded.max_context_length
        )
        if done:
            return outcome
        return Again(
            dataclasses.replace(
                job, num_verified=outcome.num_verified, max_tokens=job.max_tokens - made, session=session
            )
        )

    def _observe(self, rows: int, forward_seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.batch_size.observe(rows)
            self.metrics.forward_seconds.observe(forward_seconds)
            self.metrics.active_sessions.set(len(self.sessions))
            self.metrics.kv_slots_in_use.set(self.backend.in_use)

    def _sweep(self, now: float) -> None:
        idle = [sid for sid, session in self.sessions.items() if now - session.last_used > self.config.session_ttl_s]
        for session_id in idle:
            log.warning("releasing session %s: idle for more than %.0f s", session_id, self.config.session_ttl_s)
            self._release(session_id)

    def _release(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.backend.close(session.sequence)
            if self.local is not None:
                self.local.close(session.drafts, session.tokens)
        if self.metrics is not None:
            self.metrics.active_sessions.set(len(self.sessions))
            self.metrics.kv_slots_in_use.set(self.backend.in_use)

    def _prepare(self, job: PrefillJob | VerifyJob | DecodeJob) -> Row:
        if isinstance(job, PrefillJob):
            return self._prepare_prefill(job)
        if isinstance(job, DecodeJob):
            require(job.max_tokens >= 1, "max_tokens must be at least 1")
            row = self._prepare_verify(job.as_verify())
            if job.speculation is not None:
                self._prepare_drafts(job, row.session)
            return row
        return self._prepare_verify(job)

    def _observe_round(self, job: DecodeJob, session: Session, outcome: Outcome) -> None:
        """Feeds a decode's round to the K choice: all it took since the previous round (since
        its batch started, for a call's first)."""
        if job.session is None:
            session.last_decided_ns = 0
        since = session.last_decided_ns or outcome.draft_started_ns or outcome.batch_started_ns
        session.last_decided_ns = outcome.decided_ns
        if self.local is None or outcome.forced:  # a forced round is the grammar's, not the method's
            return
        round_s = (outcome.decided_ns - since) / 1e9
        if job.speculation is not None:
            session.drafts.observe(outcome, round_s)
        else:
            self.local.observe_target_only(outcome, round_s, not (job.sampling or session.sampling).is_greedy)

    def _prepare_drafts(self, job: DecodeJob, session: Session) -> None:
        """The session's colocated drafting for a speculative decode (its first round: opened
        or, for other settings, replaced; a new call's rounds time themselves afresh)."""
        methods = self.local.methods if self.local is not None else ("none",)
        require(
            job.speculation.method in methods,
            f"this verifier drafts for {', '.join(methods)}, not {job.speculation.method}",
        )
        require(
            job.speculation.num_speculative_tokens <= self.config.max_speculative_tokens,
            f"at most {self.config.max_speculative_tokens} draft tokens per round",
        )
        if job.speculation.tree is not None:
            check_tree_speculation(
                job.speculation.tree, self.backend.supports_trees, self.config.max_speculative_tokens
            )
        sampled = not (job.sampling or session.sampling).is_greedy
        drafts = self.local.session_drafts(session.drafts, job.speculation, session.prompt_length, sampled)
        if drafts is not session.drafts and drafts.eagle is not None and session.hidden is not None:
            drafts.eagle.observe(len(session.tokens) - 2, session.hidden[None])  # the last token's logits'
        session.drafts = drafts
        session.drafts.grammar = session.grammar  # the drafts' q follow it too

    def _draft_locally(self, jobs: list[Job], rows: list[tuple[int, Row]]) -> DraftTiming | None:
        """Drafts every speculative decode's round at once, before the batch's forward: each
        row's K from its session's chooser (in a batch, one K for the sessions that draft
        alike: LocalDrafting.next_rounds), its drafts into the row (a grammar's forced tokens
        instead, where it forces some)."""
        self.grammar_rounds.jump_forward(jobs, rows, self.loaded.max_context_length)
        speculative = [
            (jobs[i], row)
            for i, row in rows
            if isinstance(jobs[i], DecodeJob) and jobs[i].speculation is not None and not row.forced
        ]
        if not speculative:
            return None
        rooms = [
            (row.session.drafts, min(job.max_tokens, self.loaded.max_context_length - len(row.session.tokens)))
            for job, row in speculative
        ]
        lengths = [len(row.session.tokens) for _, row in speculative]
        wanted = [
            (row.session.drafts, row.session.tokens, choice, row.sampling, row.session.hidden)
            for (_, row), choice in zip(speculative, self.local.next_rounds(rooms, len(rows), lengths))
        ]
        proposals, timing = self.local.propose(wanted)
        for (_, row), proposal in zip(speculative, proposals):
            row.drafts, row.distributions = proposal.draft_token_ids, proposal.draft_distributions
            row.feed = [row.feed[0], *row.drafts]
            row.drafted_locally = bool(row.drafts)
            if proposal.draft_parents:
                row.parents = [-1, *proposal.draft_parents]
                row.window = proposal.window_nodes
        return timing

    def _prepare_prefill(self, job: PrefillJob) -> Row:
        require(bool(job.session_id), "session_id must not be empty")
        require(len(job.token_ids) >= 1, "token_ids must not be empty")
        require(
            len(job.token_ids) < self.loaded.max_context_length,
            f"{len(job.token_ids)} tokens leave no room in the context window of {self.loaded.max_context_length}",
        )
        check_token_ids(job.token_ids, self.loaded.vocab_size, "token_ids")
        check_token_ids(job.sampling.processing.token_ids(), self.loaded.vocab_size, "sampling's token ids")
        require(job.prompt_length <= len(job.token_ids), "prompt_length must not exceed the tokens sent")
        top = job.prompt_logprobs
        require(top is None or 0 <= top <= MAX_TOP_LOGPROBS, f"prompt_top_logprobs must lie in 0..{MAX_TOP_LOGPROBS}")
        existing = self.sessions.get(job.session_id)
        if existing is not None:  # a restart of the session reuses its cache slot
            existing.sequence.truncate(0)
            if self.local is not None:
                self.local.close(existing.drafts, existing.tokens)
                existing.drafts = None
            sequence, is_new = existing.sequence, False
        else:
            self.backend.trim_branches()  # where no slot is free, token trees' branch slots go back first
            sequence, is_new = self.backend.open(), True  # raises ResourceExhausted when full
        session = Session(list(job.token_ids), sequence, job.sampling, grammar=job.grammar)
        session.prompt_length = job.prompt_length or len(job.token_ids)
        feed = list(job.token_ids)
        if job.copy_of and job.prompt_logprobs is None and self._copied(job, sequence):
            feed = feed[-1:]  # the rest is in the cache already, copied
        row = Row(
            job.session_id,
            session,
            feed=feed,
            drafts=(),
            distributions=(),
            sampling=job.sampling,
            first_position=len(job.token_ids),
            is_new=is_new,
            is_prefill=True,
        )
        if job.prompt_logprobs is not None:
            row.prompt_logprobs, row.prompt_top = [], job.prompt_logprobs  # asked for: the forward fills it
        return row

    def _copied(self, job: PrefillJob, sequence) -> bool:
        """Copies into sequence the cache of job.token_ids but the last from session job.copy_of,
        where it holds them (another choice of the same request); whether it did."""
        source = self.sessions.get(job.copy_of) if job.copy_of != job.session_id else None
        n = len(job.token_ids)
        held = source is not None and n >= 2 and source.sequence.length >= n - 1
        return (
            held
            and tuple(source.tokens[:n]) == job.token_ids
            and self.backend.copy_prefix(source.sequence, sequence, n - 1)
        )

    def _prepare_verify(self, job: VerifyJob) -> Row:
        session = self.sessions.get(job.session_id)
        if session is None:
            raise FailedPrecondition(f"unknown session {job.session_id!r}; prefill it first", 0)
        if job.num_verified != len(session.tokens):
            raise FailedPrecondition(
                f"session holds {len(session.tokens)} verified tokens, call assumes {job.num_verified}",
                len(session.tokens),
            )
        sampling = job.sampling or session.sampling
        check_token_ids(sampling.processing.token_ids(), self.loaded.vocab_size, "sampling's token ids")
        job.check_drafts(sampling, self.config.max_speculative_tokens, self.loaded)
        if job.draft_parents:
            check_tree(job, sampling, self.backend.supports_trees)
        session.sequence.truncate(len(session.tokens) - 1)  # also undoes a forward whose batch failed
        feed = [session.tokens[-1], *job.draft_token_ids]
        row = Row(
            job.session_id,
            session,
            feed=feed,
            drafts=job.draft_token_ids,
            distributions=job.draft_distributions,
            sampling=sampling,
            first_position=job.num_verified,
            is_new=False,
            is_prefill=False,
        )
        if job.draft_parents:
            row.parents = [-1, *job.draft_parents]
        return row

    def _forward(self, rows: list[Row]) -> None:
        masking = self.grammar_rounds.before_forward(rows)  # the grammars' masks, alongside
        budget = self.config.max_batched_tokens
        try:
            scoring = [row for row in rows if row.prompt_logprobs is not None]  # each alone, in chunks, first
            again = {id(row) for row in scoring if score_prompt(self.backend, row, budget)}
            chains = [r for r in rows if r.parents is None and (r.prompt_logprobs is None or id(r) in again)]
            forward_rows = [ForwardRow(row.session.sequence, row.feed, len(row.drafts) + 1) for row in chains]
            for row, (logits, argmax) in zip(chains, forward_in_budget(self.backend, forward_rows, budget)):
                row.logits, row.argmax = logits, argmax
            trees = [row for row in rows if row.parents is not None]
            parts = [tree_nodes(self.backend, row) for row in trees]
            for row, (logits, argmax) in zip(trees, self.backend.forward_trees(parts) if trees else ()):
                row.logits, row.argmax = logits, argmax
                if row.window:  # the window's guesses to its session; the decision reads the rest
                    row.session.drafts.lookahead.learn(split_window(row))
        finally:  # the masks touch the sessions' grammars: done before anything else may
            if masking is not None:
                wait([masking])
        if masking is not None:
            masking.result()
        for row in [*chains, *(row for row in scoring if id(row) not in again), *trees]:
            process_logits(row, self.loaded.eos_token_ids)

    def _commit(self, row: Row, num_accepted: int, next_token: int) -> Outcome:
        kept = row.drafts if row.path is None else keep_path(self.backend, row)
        ends = () if row.sampling.ignore_eos else self.loaded.eos_token_ids
        num_accepted, next_token = stop_at_end_of_sequence(kept, num_accepted, next_token, ends)
        hidden = row.session.sequence.hidden  # of the rows whose logits the forward gave
        last = num_accepted if row.path is None else [0, *row.path][num_accepted]  # the next token's
        row.session.hidden = hidden[last].clone() if hidden is not None and last < hidden.shape[0] else None
        session = row.session
        eagle = session.drafts.eagle if session.drafts is not None else None
        if eagle is not None and hidden is not None and row.path is None and num_accepted < hidden.shape[0]:
            eagle.observe(len(session.tokens) - 1, hidden[: num_accepted + 1].clone())  # the kept positions
        accepted = tuple(kept[:num_accepted])
        session.tokens.extend(accepted)
        session.tokens.append(next_token)
        if session.grammar is not None:
            session.grammar.advance([*accepted, next_token])
        session.sequence.truncate(len(session.tokens) - 1)
        session.last_used = time.monotonic()
        self.sessions[row.session_id] = session
        return Outcome(
            num_accepted,
            next_token,
            len(session.tokens),
            row.batch_size,
            accepted,
            len(row.drafts),
            tree=row.parents is not None,
            forced=row.forced,
            mask_seconds=row.mask_seconds,
            **logprobs_of(row, [*accepted, next_token]),
        )
