"""The Backend over transformers' own forward: the fallback for architectures the runner
does not know (chosen automatically and logged)."""

from __future__ import annotations

import torch

from specserve.errors import ResourceExhausted
from specserve.model.backends.base import ForwardRow, KVSequence, TreeNodes


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

    def has_run(self, kind: str, steps: int) -> bool:
        return False

    def greedy_continue(self, sequence: KVSequence, token: int, steps: int) -> list[int] | None:
        return None

    def sampled_continue(
        self, sequence: KVSequence, token: int, temperature: float, top_p: float, noise: torch.Tensor
    ) -> None:
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
