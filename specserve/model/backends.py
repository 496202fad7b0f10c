"""Model backends with one interface: our Llama-family runner, or transformers as the
fallback for architectures the runner does not know (chosen automatically and logged).

A KVSequence is one session's place in a backend's KV cache. forward() appends tokens to
several sequences in one call and returns the logits of each row's last tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specserve.errors import ResourceExhausted

log = logging.getLogger(__name__)


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

    def greedy_continue(self, sequence: KVSequence, token: int, steps: int) -> list[int] | None:
        """A greedy draft continued as one call (token fed first, each argmax fed next):
        the steps tokens made, or None where the backend has no such call for steps."""
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


class RunnerBackend:
    name = "runner"

    def __init__(self, runner):
        self.runner = runner
        self.vocab_size = runner.spec.vocab_size
        self.max_context_length = runner.max_len
        self._branched: dict[int, KVSequence] = {}  # sequences holding branch slots

    @property
    def compiling(self) -> bool:
        steps = self.runner.compiled_steps
        return steps is not None and steps.compiling

    @property
    def steps_built(self) -> bool:
        """Whether the one-token steps are compiled (or failed, or not asked for): what a
        service waits for before it reports ready."""
        steps = self.runner.compiled_steps
        return steps is None or steps.ready or steps.failed

    @property
    def in_use(self) -> int:
        return self.runner.num_slots - self.runner.free_slots

    @property
    def capacity(self) -> int:
        return self.runner.num_slots

    def open(self, reclaim: bool = True) -> KVSequence:
        """reclaim: take a tree's branch slot when none is free (only where no tree runs at
        the same time: the drafter's streams open sessions on threads of their own)."""
        slot = self.runner.allocate()
        if slot is None and reclaim and self._branched:  # sessions come before the branches of trees
            self._drop_branches(next(iter(self._branched.values())))
            slot = self.runner.allocate()
        if slot is None:
            raise ResourceExhausted(f"all {self.runner.num_slots} KV-cache slots are in use")
        return KVSequence(slot)

    def close(self, sequence: KVSequence) -> None:
        self._drop_branches(sequence)
        if sequence.slot >= 0:
            self.runner.release(sequence.slot)
            sequence.slot = -1

    @property
    def supports_trees(self) -> bool:
        return self.runner.exact_attention

    def reserve_branches(self, sequence: KVSequence, count: int) -> int:
        while len(sequence.branch_slots) < count - 1:
            slot = self.runner.allocate()
            if slot is None:
                break
            sequence.branch_slots.append(slot)
            sequence.branch_synced.append(0)
            self._branched[id(sequence)] = sequence
        return min(count, 1 + len(sequence.branch_slots))

    def forward_trees(self, parts: list[TreeNodes]) -> list[tuple[torch.Tensor, list[int] | None]]:
        tokens, positions, read, write = [], [], [], []
        for part in parts:
            sequence = part.sequence
            slots = [sequence.slot, *sequence.branch_slots]
            for branch, synced in enumerate(sequence.branch_synced, start=1):  # each branch's context first
                self.runner.copy_positions(sequence.slot, slots[branch], synced, sequence.length)
            sequence.branch_synced = [sequence.length] * len(sequence.branch_slots)
            for token, depth, on in zip(part.tokens, part.depths, part.on):
                tokens.append(token)
                positions.append(part.base + depth)
                read.append(slots[on[0]])
                write.append([slots[branch] for branch in on])
        logits, argmax, hidden = self.runner.forward_nodes(tokens, positions, read, write)
        out, end = [], 0
        for part in parts:
            end += len(part.tokens)
            start = end - len(part.tokens)
            part.sequence.hidden = hidden[start:end]
            out.append((logits[start:end], argmax[start:end] if argmax is not None else None))
        return out

    def keep_branch(self, sequence: KVSequence, branch: int, end: int) -> None:
        if branch > 0:
            self.runner.copy_positions(sequence.branch_slots[branch - 1], sequence.slot, sequence.length, end)
        sequence.length = end

    def copy_prefix(self, source: KVSequence, target: KVSequence, length: int) -> bool:
        self.runner.copy_positions(source.slot, target.slot, 0, length)
        target.length = length
        target.branch_synced = [0] * len(target.branch_slots)  # their copies of it are stale
        return True

    def trim_branches(self) -> None:
        """Gives every tree's branch slots back where no slot is free (a drafter's, between
        its batches: new sessions come first)."""
        if self.runner.free_slots == 0:
            for sequence in list(self._branched.values()):
                self._drop_branches(sequence)

    def _drop_branches(self, sequence: KVSequence) -> None:
        for slot in sequence.branch_slots:
            self.runner.release(slot)
        sequence.branch_slots, sequence.branch_synced = [], []
        self._branched.pop(id(sequence), None)

    def forward(self, rows: list[ForwardRow]) -> list[torch.Tensor]:
        return [logits for logits, _ in self.forward_with_argmax(rows)]

    def forward_with_argmax(self, rows: list[ForwardRow]) -> list[tuple[torch.Tensor, list[int] | None]]:
        logits, argmax, hidden = self.runner.forward_with_argmax(
            [row.sequence.slot for row in rows],
            [row.sequence.length for row in rows],
            [row.tokens for row in rows],
            [row.num_logits for row in rows],
        )
        for row, normed in zip(rows, hidden):
            row.sequence.length += len(row.tokens)
            row.sequence.hidden = normed
        return list(zip(logits, argmax))

    @property
    def scores_precisely(self) -> bool:
        return self.runner.precise_weights is not None

    def forward_scoring(self, row: ForwardRow) -> torch.Tensor:
        if not self.scores_precisely:
            return self.forward([row])[0]
        logits, normed = self.runner.forward_scoring(row.sequence.slot, row.sequence.length, row.tokens)
        row.sequence.length += len(row.tokens)
        row.sequence.hidden = normed
        return logits[-row.num_logits :]

    def forward_last(self, rows: list[ForwardRow]) -> tuple[torch.Tensor, list[int]]:
        logits, argmax = self.runner.forward_last(
            [row.sequence.slot for row in rows], [row.sequence.length for row in rows], [row.tokens for row in rows]
        )
        for row in rows:
            row.sequence.length += len(row.tokens)
        return logits, argmax

    def greedy_continue(self, sequence: KVSequence, token: int, steps: int) -> list[int] | None:
        compiled = self.runner.compiled_steps
        if compiled is None or not compiled.ready or sequence.length + steps > self.runner.max_len:
            return None
        made = compiled.greedy_run(sequence.slot, sequence.length, token, steps)
        if made is not None:
            sequence.length += steps
        return made


class TransformersBackend:
    """transformers' own forward with a DynamicCache per sequence, one row at a time."""

    name = "transformers"
    compiling = False
    steps_built = True
    supports_trees = False

    def __init__(self, model, device: torch.device, max_context_length: int, max_sequences: int):
        self.model = model
        self.device = device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context_length = max_context_length
        self._max_sequences = max_sequences
        self._open = 0

    @property
    def in_use(self) -> int:
        return self._open

    @property
    def capacity(self) -> int:
        return self._max_sequences

    def open(self, reclaim: bool = True) -> KVSequence:
        from transformers import DynamicCache

        if self._open >= self._max_sequences:
            raise ResourceExhausted(f"all {self._max_sequences} sequences are in use")
        self._open += 1
        return KVSequence(-1, 0, DynamicCache())

    def close(self, sequence: KVSequence) -> None:
        if sequence.hf_cache is not None:
            self._open -= 1
            sequence.hf_cache = None

    @torch.inference_mode()
    def forward(self, rows: list[ForwardRow]) -> list[torch.Tensor]:
        out = []
        for row in rows:
            ids = torch.tensor([row.tokens], dtype=torch.long, device=self.device)  # [1, n]
            logits = self.model(input_ids=ids, cache=row.sequence.hf_cache, use_cache=True).logits[0]
            row.sequence.length += len(row.tokens)
            out.append(logits[-row.num_logits :].float())
        return out

    def forward_with_argmax(self, rows: list[ForwardRow]) -> list[tuple[torch.Tensor, list[int] | None]]:
        return [(logits, None) for logits in self.forward(rows)]

    scores_precisely = False

    def forward_scoring(self, row: ForwardRow) -> torch.Tensor:
        return self.forward([row])[0]

    def forward_last(self, rows: list[ForwardRow]) -> tuple[torch.Tensor, list[int]]:
        logits = torch.cat([x[-1:] for x in self.forward(rows)])
        return logits, logits.argmax(-1).tolist()

    def greedy_continue(self, sequence: KVSequence, token: int, steps: int) -> list[int] | None:
        return None

    def reserve_branches(self, sequence: KVSequence, count: int) -> int:
        return 1

    def forward_trees(self, parts: list[TreeNodes]) -> list[tuple[torch.Tensor, list[int] | None]]:
        raise NotImplementedError("token trees need the runner backend")

    def keep_branch(self, sequence: KVSequence, branch: int, end: int) -> None:
        raise NotImplementedError("token trees need the runner backend")

    def trim_branches(self) -> None:
        pass

    def copy_prefix(self, source: KVSequence, target: KVSequence, length: int) -> bool:
        return False  # a choice of n prefills its prompt itself


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
