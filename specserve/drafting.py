"""The drafter: extends each session's draft state with the newly verified tokens and
proposes up to K draft tokens, each with the exact sparse distribution q_i it was drawn from.
The draft service runs it for the gateway's rounds; the verifier runs one of its own for
requests it drafts for itself (colocated drafting, no round trip per round).

Methods: "draft_model" (a small model of its own), "early_exit" (the target's first layers,
final norm and LM head), and two without a model: "ngram" (copy what followed the latest
earlier occurrence of the sequence's longest repeated suffix) and "suffix" (follow the
counts of what followed the sequence's end, in the session and in its tenant's finished
sessions: specserve/methods/suffix.py). For the model methods q_i is the processed distribution
(temperature, top-k, top-p) truncated to the support_size likeliest tokens and
renormalised (docs/design.md, invariant 2); the others' drafts are deterministic, so their
q_i is one-hot. Greedy requests get no distributions. A model stops drafting early once its
likeliest next token falls below min_draft_probability (adaptive length).

A model's chain starts with a copy where the context repeats: when the sequence's last
copy_min_ngram (0: never) or more tokens occurred before, and such copies have held the
target's tokens at least as often as the model's drafts in the session, the first drafts
are what followed them (one-hot), read in the model's catch-up forward, and the model
drafts the rest of K (docs/design.md, "A copy before the draft").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from specserve.draft_jobs import DraftJob, DraftOptions, DraftSession, Proposal
from specserve.errors import FailedPrecondition, InvalidArgument, RequestError, ResourceExhausted, require
from specserve.methods import registry
from specserve.methods.ngram import common_prefix, ngram_drafts, one_hot
from specserve.methods.tree_drafting import draft_trees
from specserve.model.backends import Backend, ForwardRow, forward_in_budget
from specserve.model.loading import LoadedModel
from specserve.protocol import SparseDistribution, check_token_ids
from specserve.sampling import SamplingParams, draft_noise, processed_probs, sample_sparse, truncate_to_support
from specserve.serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)

# A catch-up of at most this many tokens per row runs as one step of token rows (the accepted
# drafts the cache lacks and the round's last token, usually); a new session's prompt in chunks.
CATCH_UP_STEP_TOKENS = 16


@dataclass
class _Drafting:
    """One job's progress through a batch."""

    job: DraftJob
    verified: list[int]
    k: int
    start: int = 0  # where the job's tokens start: the session's cache held the verified tokens before it
    offered: list[int] = field(default_factory=list)  # what the context offered to copy
    copied: list[int] = field(default_factory=list)  # the drafts copied from it, read in the catch-up
    drafts: list[int] = field(default_factory=list)
    distributions: list[SparseDistribution] = field(default_factory=list)
    bonus_guess: int = -1
    parents: list[int] = field(default_factory=list)  # a tree's
    process: bool = False  # the request's logits processing shapes the draft's logits (DraftOptions.process_logits)

    def processed(self, logits: torch.Tensor, added: list[int]) -> torch.Tensor:
        """The draft's logits [vocab] at a position after the request's logits processing,
        from the output and then added (the round's drafts before the position), as the
        verifier processes the target's there: penalised drafts follow the penalised target;
        then masked by the session's grammar, where it has one (structured outputs: the
        drafts are legal). Unchanged where the request asks for neither, or the drafter
        does not process."""
        if self.process:
            session = self.job.session
            after = self.job.sampling.processing.after(self.verified, session.prompt_length, session.eos_token_ids)
            logits = after(logits, added)
        if self.job.grammar is not None:
            logits = self.job.grammar.masked(logits[None], [list(added)])[0]
        return logits

    @property
    def shaped(self) -> bool:
        """Whether the draft's logits are shaped (processed, or masked by a grammar)."""
        return self.process or self.job.grammar is not None

    def draws_at(self, i: int) -> bool:
        """Whether position i (0 = the first draft) is drawn: a draft, or the bonus guess."""
        return i < self.k or (i == self.k and self.job.want_bonus_guess and len(self.drafts) == self.k)


class Drafter:
    def __init__(self, models: dict[str, LoadedModel], options: DraftOptions, metrics: ServiceMetrics | None = None):
        """models maps the model methods served (draft_model, early_exit) to loaded models;
        the methods that draft from the context (ngram, suffix: the registry's with a
        context proposer) need none and are always served."""
        self.models = models
        self.options = options
        self.metrics = metrics
        self._sessions = 0
        self._lock = threading.Lock()  # open and close come from stream threads
        # Each context method's proposer: what it learns is shared across its sessions.
        self.proposers = {
            name: spec.context(options) for name, spec in registry.SPECS.items() if spec.context is not None
        }

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods it serves: its models' and the context methods."""
        return (*self.models, *self.proposers)

    def open_session(
        self, session_id: str, method: str, tenant: str = "", isolated: bool = False, prompt_length: int = 0
    ) -> DraftSession:
        """Method suffix learns from the finished sessions of the same tenant (none: isolated).
        prompt_length: the verified tokens that are the prompt (0: all the first job sends)."""
        method = method or "draft_model"
        spec = registry.spec_of(method)
        if method not in self.methods:
            why = f"it needs {spec.needs}" if spec.model else "the verifier drafts it from the target itself"
            raise InvalidArgument(f"{method} is not served here ({why}); served: {', '.join(self.methods)}")
        proposer = self.proposers.get(method)
        with self._lock:
            if self._sessions >= self.options.max_sessions:
                raise ResourceExhausted(f"the drafter holds its maximum of {self.options.max_sessions} sessions")
            sequence = None if proposer is not None else self.models[method].backend.open(reclaim=False)
            self._sessions += 1
            self._observe_sessions()
        context = proposer.open(tenant, isolated) if proposer is not None else None
        eos = () if proposer is not None else self.models[method].eos_token_ids
        return DraftSession(
            session_id, method, sequence, context=context, prompt_length=prompt_length, eos_token_ids=eos
        )

    def close_session(self, session: DraftSession) -> None:
        proposer = self.proposers.get(session.method)
        if proposer is not None:
            proposer.finish(session.context, session.verified)
        with self._lock:
            if session.sequence is not None:
                self.models[session.method].backend.close(session.sequence)
            self._sessions -= 1
            self._observe_sessions()

    def _observe_sessions(self) -> None:
        if self.metrics is not None:
            self.metrics.active_sessions.set(self._sessions)
            self.metrics.kv_slots_in_use.set(sum(m.backend.in_use for m in self.models.values()))

    def step(self, jobs: list[DraftJob]) -> list[Proposal | BaseException]:
        """Drafts for every session of the batch together: per model, one forward to catch
        up on the verified tokens, then one forward per draft position over the rows still
        drafting; n-gram sessions need no forward."""
        results: list[Proposal | BaseException | None] = [None] * len(jobs)
        groups: dict[str, list[tuple[int, _Drafting]]] = {}
        for index, job in enumerate(jobs):
            try:
                drafting = self._start(job)
            except Exception as error:  # noqa: BLE001 - one bad request must not fail its batch
                if not isinstance(error, RequestError):
                    log.exception("drafting failed")
                results[index] = error
                continue
            groups.setdefault(job.session.method, []).append((index, drafting))
        started = time.time_ns()
        for method, group in groups.items():
            self._run_group(method, [drafting for _, drafting in group])
        ended = time.time_ns()
        active = [item for group in groups.values() for item in group]
        for index, d in active:
            d.job.session.verified = d.verified
            if d.job.tree is None:
                d.job.session.copy_score.proposed(len(d.verified), d.drafts, d.offered, len(d.copied))
            results[index] = Proposal(
                len(d.verified),
                tuple(d.drafts),
                draft_distributions=tuple(d.distributions),
                bonus_guess=d.bonus_guess,
                batch_size=len(active),
                batch_started_ns=started,
                batch_ended_ns=ended,
                draft_parents=tuple(d.parents),
            )
        for model in self.models.values():
            model.backend.trim_branches()
        if self.metrics is not None and active:
            self.metrics.batch_size.observe(len(active))
            self.metrics.forward_seconds.observe((ended - started) / 1e9)
        return results  # type: ignore[return-value]

    def _run_group(self, method: str, batch: list[_Drafting]) -> None:
        proposer = self.proposers.get(method)
        if proposer is not None:
            vocab = self.options.vocab_size
            for d in batch:
                drafts = list(proposer.drafts(d.job.session.context, d.verified, d.start, d.k))[: d.k]
                # A proposer's drafts end where one is no token of the vocabulary (a method
                # registered from outside the project is trusted with nothing more).
                d.drafts = next((drafts[:i] for i, t in enumerate(drafts) if not 0 <= t < vocab), drafts)
                if not d.job.sampling.is_greedy:
                    d.distributions = one_hot(d.drafts)
            return
        backend = self.models[method].backend
        try:
            chains = [d for d in batch if d.job.tree is None]
            trees = [d for d in batch if d.job.tree is not None]
            if chains:
                self._draft_all(backend, chains)
            if trees:
                draft_trees(self, backend, trees)
        except BaseException:
            for d in batch:  # the caches may hold half a round: resync from scratch next time
                d.job.session.cached_tokens = []
                d.job.session.sequence.truncate(0)
            raise

    def _start(self, job: DraftJob) -> _Drafting:
        self._check(job)
        start = job.num_verified - len(job.tokens)
        verified = job.session.verified  # extended in place: what it holds up to start stays verified
        del verified[start:]  # a start before the end rewinds
        verified.extend(job.tokens)
        job.session.prompt_length = job.session.prompt_length or len(verified)
        _, context = self._limits(job.session.method)
        room = context - len(verified) - (1 if job.want_bonus_guess else 0)
        d = _Drafting(job, verified, max(0, min(job.num_speculative_tokens, room)), start=start)
        d.process = self.options.process_logits and job.sampling.processing.active
        copy_n = self.options.copy_min_ngram
        if copy_n and job.session.method in self.models and job.tree is None:
            job.session.copy_score.judge(verified)
            d.offered = ngram_drafts(verified, d.k, self.options.ngram_max, min_n=copy_n)
            d.copied = list(d.offered) if job.session.copy_score.prefers_copy() else []
            d.drafts = list(d.copied)
            if not job.sampling.is_greedy:
                d.distributions = one_hot(d.copied)
        return d

    def _limits(self, method: str) -> tuple[int, int]:
        """(vocabulary size, context window) a method's sessions must keep within: the
        service's, and its model's where that is smaller (a draft's output layer may be padded
        to another size than the target's, and its context may be shorter)."""
        vocab, context = self.options.vocab_size, self.options.max_context_length
        model = self.models.get(method)
        if model is None:
            return vocab, context
        return min(vocab, model.vocab_size), min(context, model.max_context_length)

    def _draft_all(self, backend: Backend, batch: list[_Drafting]) -> None:
        """Per position, one forward over the rows still drafting: a catch-up on the verified
        tokens first, then one token per row. Each forward gives the last token's logits and
        argmax (a greedy draft's token) of each row. A lone session drafts in one call where it
        can (_lone_run)."""
        rows = [self._catch_up_row(d) for d in batch]
        if len(batch) == 1 and self._lone_run(backend, batch[0], rows[0]):
            return
        logits, argmax = self._catch_up(backend, rows)
        position = [len(d.copied) for d in batch]  # each row's next draft position; its logits are for it
        drawing = [b for b, d in enumerate(batch) if d.draws_at(position[b])]
        while drawing:
            for b in drawing:
                self._draw_into(batch[b], logits[b], argmax[b], position[b])
            drawing = [b for b in drawing if batch[b].draws_at(position[b] + 1)]
            if not drawing:
                return
            feed = [ForwardRow(batch[b].job.session.sequence, [batch[b].drafts[-1]], 1) for b in drawing]
            new_logits, new_argmax = backend.forward_last(feed)
            for j, b in enumerate(drawing):
                batch[b].job.session.cached_tokens.append(batch[b].drafts[-1])
                logits[b], argmax[b] = new_logits[j], new_argmax[j]
                position[b] += 1

    def _lone_run(self, backend: Backend, d: _Drafting, row: ForwardRow) -> bool:
        """A lone session's K drafts as one call where the backend has a run for them (greedy,
        or sampled at a temperature and top_p alone): the catch-up's last token is the run's
        first step, its tokens before it (if any) a forward of their own. Whether it drafted;
        where not, row is left for the catch-up (less the tokens fed)."""
        job, sampling = d.job, d.job.sampling
        if job.min_draft_probability > 0 or job.want_bonus_guess or d.shaped:  # these draw step by step
            return False
        steps = d.k - len(d.copied)  # drafts the model makes
        kind = "greedy" if sampling.is_greedy else "sampled"
        if steps < 1 or (kind == "sampled" and (sampling.top_k or sampling.min_p)):
            return False
        if not backend.has_run(kind, steps):
            return False
        if len(row.tokens) > 1:  # the cache first takes the tokens before the last
            self._catch_up(backend, [ForwardRow(row.sequence, row.tokens[:-1], 1)])
            del row.tokens[:-1]
        token, position = row.tokens[0], len(d.verified) + len(d.copied)
        if kind == "greedy":
            made = backend.greedy_continue(row.sequence, token, steps)
        else:
            width = min(self.options.support_size, backend.vocab_size)
            noise = draft_noise(sampling.seed, position, steps, width, backend.device)
            run = backend.sampled_continue(row.sequence, token, sampling.temperature, sampling.top_p, noise)
            if run is None:
                return False
            made = run[0].tolist()
            d.distributions.extend(_sparse(ids, q) for ids, q in zip(run[1].tolist(), run[2].tolist()))
        if made is None:
            return False
        d.drafts.extend(made)
        job.session.cached_tokens.extend(made[:-1])  # the last draft's keys are not made
        return True

    def _catch_up(self, backend: Backend, rows: list[ForwardRow]) -> tuple[list[torch.Tensor], list[int]]:
        """Each row's last logits [vocab] and argmax after feeding it: rows of a few tokens in
        one step, long ones (a new session's prompt) in the token budget's chunks."""
        if all(len(row.tokens) <= CATCH_UP_STEP_TOKENS for row in rows):
            logits, argmax = backend.forward_last(rows)
            return list(logits), argmax
        logits = [x[-1] for x, _ in forward_in_budget(backend, rows, self.options.max_batched_tokens)]
        return logits, [int(x.argmax()) for x in logits]

    def _draw_into(self, d: _Drafting, logits: torch.Tensor, argmax: int, i: int) -> None:
        """Position i's draw from the draft's logits [vocab] (argmax: their argmax, a greedy
        request's draw, before the request's logits processing)."""
        sampling, position = d.job.sampling, len(d.verified) + i
        if d.shaped:
            logits = d.processed(logits, d.drafts)
            argmax = int(logits.argmax())
        if i == d.k:  # the bonus guess: a draw like the others, kept apart
            d.bonus_guess = argmax if sampling.is_greedy else self._draw(logits, sampling, position)[0]
            return
        if d.job.min_draft_probability > 0 and _top_probability(logits, sampling) < d.job.min_draft_probability:
            d.k = i  # not confident: stop here, and make no bonus guess
            return
        token, distribution = (argmax, None) if sampling.is_greedy else self._draw(logits, sampling, position)
        d.drafts.append(token)
        if distribution is not None:
            d.distributions.append(distribution)

    def _catch_up_row(self, d: _Drafting) -> ForwardRow:
        """Crops the cache to its longest prefix still verified (accepted drafts stay) and
        feeds the rest, ending with the last verified token, whose logits start the draft, or
        with the drafts copied from the context after it, whose last one's logits continue
        it. The cache matches the verified tokens at least up to where this round's tokens
        start."""
        session, verified = d.job.session, d.verified
        cached = session.cached_tokens
        keep = min(common_prefix(cached, verified, min(d.start, len(cached))), len(verified) - 1)
        session.sequence.truncate(keep)
        del cached[keep:]
        feed = verified[keep:] + d.copied
        cached.extend(feed)
        return ForwardRow(session.sequence, feed, 1)

    def _check(self, job: DraftJob) -> None:
        start = job.num_verified - len(job.tokens)
        if start > len(job.session.verified) or start < 0:
            raise FailedPrecondition(
                f"draft session holds {len(job.session.verified)} verified tokens, request starts at {start}",
                len(job.session.verified),
            )
        require(job.num_verified >= 1, "the verified sequence must not be empty")
        require(
            1 <= job.num_speculative_tokens <= self.options.max_speculative_tokens,
            f"num_speculative_tokens must lie in 1..{self.options.max_speculative_tokens}",
        )
        require(0 <= job.min_draft_probability <= 1, "min_draft_probability must lie in [0, 1]")
        if job.tree is not None:
            require(job.session.method in self.models, f"{job.session.method} drafts chains: token trees need a model")
            require(
                self.models[job.session.method].backend.supports_trees,
                "token trees need the runner backend (this draft is served by transformers)",
            )
            require(
                len(job.tree) == job.num_speculative_tokens,
                f"a tree of {len(job.tree)} nodes needs num_speculative_tokens {len(job.tree)}",
            )
        vocab, context = self._limits(job.session.method)
        check_token_ids(job.tokens, vocab, "tokens")
        require(job.num_verified <= context, "the sequence exceeds the draft's context window")

    def _draw(
        self, logits: torch.Tensor, sampling: SamplingParams, position: int
    ) -> tuple[int, SparseDistribution | None]:
        if sampling.is_greedy:
            return int(torch.argmax(logits)), None
        probs = processed_probs(logits[None], sampling)[0]  # [vocab]
        ids, q = truncate_to_support(probs, self.options.support_size)
        token = sample_sparse(ids, q, sampling.seed, position)
        return token, SparseDistribution(tuple(ids.tolist()), tuple(q.tolist()))


def _sparse(ids: list[int], q: list[float]) -> SparseDistribution:
    """A run's draw distribution: its support's tokens of probability above 0."""
    kept = [(token, p) for token, p in zip(ids, q) if p > 0]
    return SparseDistribution(tuple(t for t, _ in kept), tuple(p for _, p in kept))


def _top_probability(logits: torch.Tensor, sampling: SamplingParams) -> float:
    """How sure the draft is of its next token: its largest probability, as sampled."""
    if sampling.is_greedy:
        return float(torch.softmax(logits.float(), -1).max())
    return float(processed_probs(logits[None], sampling)[0].max())
