"""The Backend over our Llama-family runner (specserve/model/runner.py): KV-cache slots,
batched rows, token trees and the compiled one-token steps."""

from __future__ import annotations

import torch

from specserve.errors import ResourceExhausted
from specserve.model.backends.base import ForwardRow, KVSequence, TreeNodes


class RunnerBackend:
    name = "runner"

    def __init__(self, runner):
        self.runner = runner
        self.device = runner.device
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

    def has_run(self, kind: str, steps: int) -> bool:
        compiled = self.runner.compiled_steps
        return compiled is not None and compiled.has_run(kind, steps)

    def greedy_continue(self, sequence: KVSequence, token: int, steps: int) -> list[int] | None:
        return self._continued(
            sequence, steps, lambda compiled: compiled.greedy_run(sequence.slot, sequence.length, token, steps)
        )

    def sampled_continue(
        self, sequence: KVSequence, token: int, temperature: float, top_p: float, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return self._continued(
            sequence,
            noise.shape[0],
            lambda compiled: compiled.sampled_run(sequence.slot, sequence.length, token, temperature, top_p, noise),
        )

    def _continued(self, sequence: KVSequence, steps: int, run):
        """run(compiled steps)'s drafts, steps more keys in the sequence; None where the steps
        are not compiled, the run is not built or the context has no room."""
        compiled = self.runner.compiled_steps
        if compiled is None or not compiled.ready or sequence.length + steps > self.runner.max_len:
            return None
        made = run(compiled)
        if made is not None:
            sequence.length += steps
        return made
