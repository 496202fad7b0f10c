"""What every backend is: the Backend protocol, a session's place in its KV cache
(KVSequence), a forward's rows (ForwardRow) and a token tree's nodes (TreeNodes), and
forward_in_budget, which runs rows in forwards of a bounded number of tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class KVSequence:
    slot: int  # the runner's cache slot (-1 for the transformers backend)
    length: int = 0  # tokens whose keys and values are in the cache
    hf_cache: object = field(default=None, repr=False)
    # Token trees: the cache slots of branches 1, 2, ... (branch 0 is slot), and how many
    # leading positions of each still hold what slot does.
    branch_slots: list[int] = field(default_factory=list)
    branch_synced: list[int] = field(default_factory=list)
    # The runner's: the normed hidden states [n, hidden] of the tokens whose logits its last
    # forward gave (a tree's: its nodes'), which Medusa heads read.
    hidden: torch.Tensor | None = field(default=None, repr=False)

    def truncate(self, length: int) -> None:
        """Rollback: forgets everything past length (the runner overwrites it next time)."""
        if length < self.length:
            if self.hf_cache is not None:
                self.hf_cache.crop(length - self.length)  # transformers takes a negative count
            self.length = length
            self.branch_synced = [min(synced, length) for synced in self.branch_synced]


@dataclass(frozen=True)
class TreeNodes:
    """Nodes of one sequence's token tree fed in one forward: node i's token at position
    base + depths[i], on the branches on[i] (specserve.methods.trees.branches), whose slots it reads
    (the first) and is stored in (all). The sequence's cache holds positions up to base (or
    base + 1, where the root was fed before)."""

    sequence: KVSequence
    base: int
    tokens: list[int]
    depths: list[int]
    on: list[list[int]]


@dataclass(frozen=True)
class ForwardRow:
    sequence: KVSequence
    tokens: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens


class Backend(Protocol):
    name: str
    device: torch.device
    vocab_size: int
    max_context_length: int

    @property
    def in_use(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Cache slots (sequences) in all: in_use / capacity is the KV-cache usage."""
        ...

    @property
    def compiling(self) -> bool:
        """Whether compiled steps are still being built (the eager forward serves meanwhile)."""
        ...

    def open(self, reclaim: bool = True) -> KVSequence: ...

    def close(self, sequence: KVSequence) -> None: ...

    def forward(self, rows: list[ForwardRow]) -> list[torch.Tensor]: ...

    def forward_with_argmax(self, rows: list[ForwardRow]) -> list[tuple[torch.Tensor, list[int] | None]]:
        """forward(), each row's logits with their argmax where the backend made it with
        them (None otherwise: the caller reduces the logits itself)."""
        ...

    def forward_last(self, rows: list[ForwardRow]) -> tuple[torch.Tensor, list[int]]:
        """The logits [batch, vocab] float32 of each row's last token, and their argmax."""
        ...

    scores_precisely: bool  # forward_scoring multiplies in float32 where the forwards do not

    def forward_scoring(self, row: ForwardRow) -> torch.Tensor:
        """A prompt's row alone, the logits [num_logits, vocab] float32 of a prompt's logprobs:
        from float32 matrices where scores_precisely (the cache then holds what they made)."""
        ...

    def has_run(self, kind: str, steps: int) -> bool:
        """Whether a run of steps steps of that kind ("greedy", "sampled": greedy_continue,
        sampled_continue) is at hand; the first ask may start building them."""
        ...

    def greedy_continue(self, sequence: KVSequence, token: int, steps: int) -> list[int] | None:
        """A greedy draft continued as one call (token fed first, each argmax fed next):
        the steps tokens made, or None where the backend has no such call for steps."""
        ...

    def sampled_continue(
        self, sequence: KVSequence, token: int, temperature: float, top_p: float, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A sampled draft continued as one call, a step per row of noise [steps, S]
        (specserve.sampling.sparse_draws; token fed first, each draw fed next): the tokens
        [steps] and the supports' ids and q [steps, S] (q 0 where a token is not kept), or
        None where the backend has no such call for steps."""
        ...

    supports_trees: bool

    def reserve_branches(self, sequence: KVSequence, count: int) -> int:
        """Makes room for a token tree of count branches: a cache slot per branch past the
        first, taken from the free ones; how many branches the sequence can have (1 .. count)."""
        ...

    def forward_trees(self, parts: list[TreeNodes]) -> list[tuple[torch.Tensor, list[int] | None]]:
        """Each part's nodes' logits [n, vocab] float32, with their argmax where made with them."""
        ...

    def keep_branch(self, sequence: KVSequence, branch: int, end: int) -> None:
        """Keeps what a tree wrote on branch up to position end: the sequence then holds end tokens."""
        ...

    def trim_branches(self) -> None: ...

    def copy_prefix(self, source: KVSequence, target: KVSequence, length: int) -> bool:
        """Makes target hold source's cache of its first length positions; whether it could."""
        ...


def forward_in_budget(
    backend: Backend, rows: list[ForwardRow], max_batched_tokens: int
) -> list[tuple[torch.Tensor, list[int] | None]]:
    """Runs rows in as few forwards as keep each under max_batched_tokens; a row longer than
    the budget (a long prompt) is prefilled alone in chunks. Per row, its logits and their
    argmax where the backend made it (Backend.forward_with_argmax)."""
    results: list = [None] * len(rows)
    group: list[int] = []
    group_tokens = 0
    for index, row in enumerate(rows):
        if len(row.tokens) > max_batched_tokens:
            results[index] = _chunked(backend, row, max_batched_tokens)
            continue
        if group and group_tokens + len(row.tokens) > max_batched_tokens:
            _run_group(backend, rows, group, results)
            group, group_tokens = [], 0
        group.append(index)
        group_tokens += len(row.tokens)
    if group:
        _run_group(backend, rows, group, results)
    return results


def _run_group(backend: Backend, rows: list[ForwardRow], group: list[int], results: list) -> None:
    for index, result in zip(group, backend.forward_with_argmax([rows[i] for i in group])):
        results[index] = result


def _chunked(backend: Backend, row: ForwardRow, chunk: int) -> tuple[torch.Tensor, list[int] | None]:
    """A long row in chunks; the logits of earlier chunks too where the row wants them (a
    prompt's logprobs), then without their argmax."""
    earlier = []
    for start in range(0, len(row.tokens) - chunk, chunk):
        wanted = min(chunk, row.num_logits - (len(row.tokens) - start - chunk))  # of the row's last num_logits
        logits = backend.forward([ForwardRow(row.sequence, row.tokens[start : start + chunk], max(1, wanted))])[0]
        if wanted > 0:
            earlier.append(logits[-wanted:])
    tail = row.tokens[(len(row.tokens) - 1) // chunk * chunk :]
    logits, argmax = backend.forward_with_argmax([ForwardRow(row.sequence, tail, min(row.num_logits, len(tail)))])[0]
    return (torch.cat([*earlier, logits]), None) if earlier else (logits, argmax)
