"""The penalties of a request's logits processing, as torch ops over sparse entries: the
reference the Triton kernel (penalties_triton.py) must equal.

Entry e is (rows[e], tokens[e]) with the token's count in that row's output and whether the
repetition penalty applies to it. In vLLM's order and arithmetic: a seen token's logit x
becomes x / repetition where positive, x * repetition otherwise; then frequency * count and
presence * (count > 0) are subtracted."""

from __future__ import annotations

import torch


def apply_penalties_reference(
    scores: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    x = scores[rows, tokens]
    x = torch.where(seen.bool(), torch.where(x > 0, x / repetition, x * repetition), x)
    scores[rows, tokens] = x - frequency * counts - presence * (counts > 0).float()
    return scores
