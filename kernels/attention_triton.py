"""Triton exact attention; same signature as attention_reference.py, results within rounding.

One program per (query token, head) walks that query's own keys in blocks that start at its
window's first key, with an online softmax in float32. Nothing in a program depends on the
other tokens of the launch, so a token's output is bitwise the same alone (a decode step) or
among the K + 1 of a verify and the rows of a batch: what greedy losslessness needs, in one
launch instead of one attention call per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _exact_attention_kernel(
    out_ptr,  # [T, heads, d], written
    q_ptr,  # [T, heads, d], last dim contiguous
    k_ptr,  # [slots, kv_heads, max_len, d] contiguous
    v_ptr,  # [slots, kv_heads, max_len, d] contiguous, strides as k
    slots_ptr,  # [T] int64
    positions_ptr,  # [T] int64
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_slot,
    cache_stride_head,
    group,  # query heads per kv head
    head_dim,
    window,  # keys within this many positions; max_len when there is no window
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= head_dim
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    end = tl.load(positions_ptr + token) + 1
    start = tl.maximum(end - window, 0)
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < head_dim
    q = tl.load(q_ptr + token * q_stride_t + head * q_stride_h + ds, mask=d_mask, other=0.0).to(tl.float32)
    kv_base = slot * cache_stride_slot + (head // group) * cache_stride_head

    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(start, end, BLOCK_N):
        ns = block + tl.arange(0, BLOCK_N)
        n_mask = ns < end
        offsets = kv_base + ns[:, None] * head_dim + ds[None, :]
        mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        scores = tl.where(n_mask, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
        new_max = tl.maximum(tl.max(scores, axis=0), e_max)  # finite: every block has a key
        rescale = tl.exp(e_max - new_max)
        p = tl.exp(scores - new_max)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        e_sum = e_sum * rescale + tl.sum(p, axis=0)
        e_max = new_max
    out = acc / e_sum
    tl.store(out_ptr + token * out_stride_t + head * out_stride_h + ds, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def exact_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_slots: torch.Tensor,
    token_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_n = max(16, min(64, 8192 // block_d))  # a [BLOCK_N, BLOCK_D] tile of at most 8192 values
    _exact_attention_kernel[(tokens, heads)](
        out,
        q,
        k_cache,
        v_cache,
        token_slots.to(torch.int64),
        token_positions.to(torch.int64),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        heads // kv_heads,
        head_dim,
        window if window else max_len,
        scale,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out
