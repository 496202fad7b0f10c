"""Exact attention, the CPU path and the Triton kernel's reference: each query token against
exactly its own keys, so a token's output does not depend on how many tokens its row
appended at once or on which rows shared the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def exact_attention_reference(
    q: torch.Tensor,  # [T, heads, d], rotated
    k_cache: torch.Tensor,  # [slots, kv_heads, max_len, d], this token's key already written
    v_cache: torch.Tensor,  # [slots, kv_heads, max_len, d]
    token_slots: torch.Tensor,  # [T] int64: each query's cache slot
    token_positions: torch.Tensor,  # [T] int64: each query's position; it sees keys up to it
    window: int | None,  # sliding window (keys within window positions), None = all
    scale: float,
    max_keys: int | None = None,  # unused here: the Triton kernel sizes its launch by it
) -> torch.Tensor:
    """Returns [T, heads, d] in q's dtype. One unmasked SDPA call per query, the very call a
    one-token decode step makes: a masked call over a padded batch rounds differently
    (~1e-7), and after 16-bit matmuls that flips near-tie argmaxes, so greedy speculative
    output would drift from target-only output."""
    heads = q.shape[1]
    queries = q[:, None, :, None, :]  # [T, 1, heads, 1, d]
    outs = []
    # 4-d operands: SDPA takes a slower path for 3-d ones (2x for one query here).
    for t, (slot, position) in enumerate(zip(token_slots.tolist(), token_positions.tolist())):
        low = max(0, position + 1 - window) if window else 0
        keys = k_cache[slot, None, :, low : position + 1]  # [1, kv_heads, keys, d], a view
        values = v_cache[slot, None, :, low : position + 1]
        outs.append(
            F.scaled_dot_product_attention(queries[t], keys, values, scale=scale, enable_gqa=heads != keys.shape[1])
        )
    return torch.cat(outs, dim=0)[:, :, 0]  # [T, heads, d]
