"""A round under a session's grammar (specserve/grammar.py; docs/design.md, "Structured
outputs"): the grammar's forced tokens as its drafts (jump-forward), a chain's drafts cut
where the grammar refuses one, before the forward, and the target's logits masked at every
position by the state after the tokens before it."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specserve.grammar import mask_with
from specserve.methods.ngram import one_hot
from verify_service.jobs import DecodeJob


class GrammarRounds:
    """The verifier's share of structured outputs in a batch: forced tokens as drafts, drafts
    cut, and masks made alongside the forward (on a helper thread: llguidance lets the GIL go
    while it computes them)."""

    def __init__(self, max_speculative_tokens: int):
        self.max_speculative_tokens = max_speculative_tokens
        self._masker: ThreadPoolExecutor | None = None

    def jump_forward(self, jobs: list, rows: list, max_context_length: int) -> None:
        """A decode's round whose grammar forces its next tokens verifies them as its drafts,
        whatever its method (none included); its method drafts the rounds after."""
        for i, row in rows:
            job = jobs[i]
            if row.session.grammar is not None and isinstance(job, DecodeJob):
                room = min(job.max_tokens, max_context_length - len(row.session.tokens)) - 1
                row.forced = jump_forward(row, min(room, self.max_speculative_tokens))

    def before_forward(self, rows: list) -> Future | None:
        """Cuts each chain's drafts where its grammar refuses one, then starts the masks of
        every row with a grammar (a tree's candidates: not a lookahead window's nodes, which
        the decision does not read); None where no row has one."""
        grammared = [row for row in rows if row.session.grammar is not None]
        for row in grammared:
            if row.drafts and row.parents is None:
                trim_drafts(row)
        if not grammared:
            return None
        for row in grammared:
            positions = 1 if row.is_prefill else len(row.feed) - row.window
            row.grammar_paths = round_paths(row, positions)
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masker.submit(make_masks, grammared)


def round_paths(row, positions: int) -> list[list[int]]:
    """The round's tokens before each of the row's first positions, after the session's: a
    chain's drafts before it, a tree node's path."""
    if row.parents is None:
        return [list(row.feed[1 : r + 1]) for r in range(positions)]
    paths = [[]]
    for node in range(1, positions):
        paths.append([*paths[row.parents[node]], row.feed[node]])
    return paths


def jump_forward(row, limit: int) -> bool:
    """Makes the tokens the grammar forces next the row's drafts (at most limit), one-hot
    where sampled: a draft that costs nothing to make, and that the target keeps unless it
    would spell the same text with other tokens. Whether there were any."""
    forced = row.session.grammar.forced()[:limit]
    if not forced:
        return False
    row.drafts = tuple(forced)
    row.distributions = () if row.sampling.is_greedy else tuple(one_hot(forced))
    row.feed = [row.feed[0], *forced]
    return True


def trim_drafts(row) -> None:
    """Cuts a chain's drafts after the first the grammar refuses, which the decision rejects
    whatever the target's logits (masked, its probability is 0): nothing after it is ever
    read. The refused draft goes too where its q is one-hot (greedy, a copy, n-gram, forced
    tokens): the residual after it is then p itself, so the bonus draw at its place gives
    the same token from the same noise. A sampled draft with a q of wider support stays, to be
    rejected by the rule, which then draws from max(0, p - q)."""
    legal = row.session.grammar.legal(list(row.drafts))
    if legal == len(row.drafts):
        return
    one_hot_q = row.sampling.is_greedy or len(row.distributions[legal].token_ids) == 1
    keep = legal if one_hot_q else legal + 1
    row.drafts, row.distributions = row.drafts[:keep], row.distributions[:keep]
    row.feed = row.feed[: keep + 1]


def make_masks(rows: list) -> None:
    """Each row's masks as bits, one row per path of row.grammar_paths (row.grammar_masks),
    and the CPU time they took: on a helper thread while the forward runs (llguidance lets
    the GIL go). No torch op runs here: one on another thread starts a second OpenMP pool,
    whose spinning threads would take the forward's cores."""
    for row in rows:
        started = time.thread_time()
        row.grammar_masks = row.session.grammar.bitmasks(row.grammar_paths)  # [positions, words]
        row.mask_seconds = time.thread_time() - started


def mask_logits(row, raw: torch.Tensor, added: list[list[int]]) -> None:
    """row.logits (processed) masked to what the grammar allows after each row's added
    tokens (its masks made alongside the forward, where they were). Where the request's own
    masks (allowed_token_ids, min_tokens, bad_words) leave none of the grammar's tokens, the
    grammar's mask applies to the raw logits instead: the output follows the grammar first."""
    grammar, bits = row.session.grammar, row.grammar_masks
    started = time.perf_counter()
    if bits is None or row.grammar_paths != added:  # a tree pruned after its masks were made
        bits = grammar.bitmasks(added)
    allowed = grammar.allowed(bits)  # [rows, vocab]
    row.mask_seconds += time.perf_counter() - started
    masked = mask_with(row.logits, allowed)
    dead = torch.isinf(masked).all(-1)
    if bool(dead.any()):
        masked[dead] = mask_with(raw.float()[dead], allowed[dead.cpu()])
    row.logits = masked
