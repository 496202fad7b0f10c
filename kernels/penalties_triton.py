"""The Triton kernel of the penalties of a request's logits processing; same signature and
results as penalties_reference.py. One program per block of entries: each loads its logit,
penalises it and stores it back (entries name distinct (row, token) pairs: no two programs
write one logit). Division correctly rounded and no fused multiply-add: the reference's
results to the bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENTRY_BLOCK = 256


@triton.jit
def _penalties_kernel(
    scores_ptr,  # [rows, vocab] float32, changed in place
    rows_ptr,  # [E] int64
    tokens_ptr,  # [E] int64
    counts_ptr,  # [E] float32
    seen_ptr,  # [E] uint8
    num_entries,
    vocab,
    presence,
    frequency,
    repetition,
    BLOCK: tl.constexpr,
):
    entries = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = entries < num_entries
    rows = tl.load(rows_ptr + entries, mask=live, other=0)
    tokens = tl.load(tokens_ptr + entries, mask=live, other=0)
    counts = tl.load(counts_ptr + entries, mask=live, other=0.0)
    seen = tl.load(seen_ptr + entries, mask=live, other=0)
    at = scores_ptr + rows * vocab + tokens
    x = tl.load(at, mask=live, other=0.0)
    x = tl.where(seen != 0, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    x = x - frequency * counts - presence * tl.where(counts > 0, 1.0, 0.0)
    tl.store(at, x, mask=live)


def apply_penalties_triton(
    scores: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    entries = rows.shape[0]
    assert scores.dtype == torch.float32 and scores.is_contiguous() and scores.dim() == 2, (
        "scores: [rows, vocab] float32"
    )
    for tensor, dtype in ((rows, torch.int64), (tokens, torch.int64), (counts, torch.float32), (seen, torch.uint8)):
        assert tensor.shape == (entries,) and tensor.dtype == dtype and tensor.is_contiguous(), "entries: [E] each"
    if entries:
        _penalties_kernel[(triton.cdiv(entries, ENTRY_BLOCK),)](
            scores,
            rows,
            tokens,
            counts,
            seen,
            entries,
            scores.shape[1],
            float(presence),
            float(frequency),
            float(repetition),
            BLOCK=ENTRY_BLOCK,
            enable_fp_fusion=False,  # torch's rounding: a product, then a difference
        )
    return scores
