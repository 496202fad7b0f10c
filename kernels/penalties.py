"""Entry point of the penalties of a request's logits processing (specserve/logit_processing.py):
the Triton kernel on CUDA, the reference on the CPU. A round's rows stay on their device: only
the entries (a few per token the output or the prompt holds) are built on the CPU."""

from __future__ import annotations

import torch

from specserve_kernels.penalties_reference import apply_penalties_reference


def apply_penalties(
    scores: torch.Tensor,  # [rows, vocab] float32, changed in place
    rows: torch.Tensor,  # [E] int64: each entry's row
    tokens: torch.Tensor,  # [E] int64: its token; (row, token) pairs are distinct
    counts: torch.Tensor,  # [E] float32: the token's count in the row's output (drafts before it included)
    seen: torch.Tensor,  # [E] uint8: 1 where the repetition penalty applies (the prompt's or the output's)
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    """scores with the repetition, frequency and presence penalties at each entry (vLLM's
    arithmetic); every other logit as it was."""
    args = (scores, rows, tokens, counts, seen, presence, frequency, repetition)
    if scores.is_cuda:
        from specserve_kernels.penalties_triton import apply_penalties_triton

        return apply_penalties_triton(*args)
    return apply_penalties_reference(*args)
