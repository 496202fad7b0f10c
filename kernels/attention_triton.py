"""Triton exact attention; same signature as attention_reference.py, results within rounding.

Split-KV, in two launches. The first runs one program per (query token, head, split): the
split's keys, at most SPLIT of the token's own, in blocks with an online softmax in float32,
leaving a partial output and its (max, sum). The second runs one program per (token, head)
and folds that token's splits in order. Splits start at the token's window's first key and a
token's number of splits depends on its position only, and no program reads another token's
data: a token's output is bitwise the same alone (a decode step), among the K + 1 of a
verify, and beside other sessions, which greedy losslessness needs. The splits keep a GPU
busy for a one-token decode of a long context, where one program per head would not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT = 256  # keys per split: a multiple of every BLOCK_N


@triton.jit
def _split_attention_kernel(
    partial_out_ptr,  # [T, heads, max_splits, BLOCK_D] float32, written
    partial_stats_ptr,  # [T, heads, max_splits, 2] float32 (max, sum), written
    q_ptr,  # [T, heads, d], last dim contiguous
    k_ptr,  # [slots, kv_heads, max_len, d] contiguous
    v_ptr,  # [slots, kv_heads, max_len, d] contiguous
    slots_ptr,  # [T] int64
    positions_ptr,  # [T] int64
    q_stride_t,
    q_stride_h,
    cache_stride_slot,
    cache_stride_head,
    heads,
    max_splits,
    group,  # query heads per kv head
    head_dim,
    window,  # keys within this many positions; max_len when there is no window
    scale,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= head_dim
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    end = tl.load(positions_ptr + token) + 1
    low = tl.maximum(end - window, 0) + split * SPLIT_KEYS
    if low < end:  # else this token has fewer splits than the launch
        high = tl.minimum(low + SPLIT_KEYS, end)
        ds = tl.arange(0, BLOCK_D)
        d_mask = ds < head_dim
        q = tl.load(q_ptr + token * q_stride_t + head * q_stride_h + ds, mask=d_mask, other=0.0).to(tl.float32)
        kv_base = slot * cache_stride_slot + (head // group) * cache_stride_head

        e_max = -float("inf")
        e_sum = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for block in range(low, high, BLOCK_N):
            ns = block + tl.arange(0, BLOCK_N)
            n_mask = ns < high
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
        row = (token * heads + head) * max_splits + split
        tl.store(partial_out_ptr + row * BLOCK_D + ds, acc)
        tl.store(partial_stats_ptr + row * 2, e_max)
        tl.store(partial_stats_ptr + row * 2 + 1, e_sum)


@triton.jit
def _combine_kernel(
    out_ptr,  # [T, heads, d], written
    partial_out_ptr,
    partial_stats_ptr,
    positions_ptr,  # [T] int64
    out_stride_t,
    out_stride_h,
    heads,
    max_splits,
    head_dim,
    window,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    end = tl.load(positions_ptr + token) + 1
    num_splits = tl.cdiv(end - tl.maximum(end - window, 0), SPLIT_KEYS)
    ds = tl.arange(0, BLOCK_D)
    first = (token * heads + head) * max_splits

    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):  # in order: the fold depends on this token alone
        split_max = tl.load(partial_stats_ptr + (first + split) * 2)
        split_sum = tl.load(partial_stats_ptr + (first + split) * 2 + 1)
        split_out = tl.load(partial_out_ptr + (first + split) * BLOCK_D + ds)
        new_max = tl.maximum(e_max, split_max)
        old_scale = tl.exp(e_max - new_max)
        split_scale = tl.exp(split_max - new_max)
        acc = acc * old_scale + split_out * split_scale
        e_sum = e_sum * old_scale + split_sum * split_scale
        e_max = new_max
    out = acc / e_sum
    tl.store(
        out_ptr + token * out_stride_t + head * out_stride_h + ds, out.to(out_ptr.dtype.element_ty), mask=ds < head_dim
    )


def exact_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_slots: torch.Tensor,
    token_positions: torch.Tensor,
    window: int | None,
    scale: float,
    max_keys: int | None = None,
    split_keys: int = SPLIT,
) -> torch.Tensor:
    """max_keys: at least every token's position + 1 (the runner knows it; None reads the
    positions, a device sync). split_keys is for tests (a multiple of 64)."""
    tokens, heads, head_dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    assert split_keys % 64 == 0
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if max_keys is None:
        max_keys = int(token_positions.max()) + 1
    window = window if window else max_len
    max_splits = triton.cdiv(min(max_keys, window), split_keys)
    block_d = triton.next_power_of_2(head_dim)
    block_n = max(16, min(64, 8192 // block_d))  # a [BLOCK_N, BLOCK_D] tile of at most 8192 values
    partial_out = torch.empty(tokens, heads, max_splits, block_d, dtype=torch.float32, device=q.device)
    partial_stats = torch.empty(tokens, heads, max_splits, 2, dtype=torch.float32, device=q.device)
    token_slots, token_positions = token_slots.to(torch.int64), token_positions.to(torch.int64)
    _split_attention_kernel[(tokens, heads, max_splits)](
        partial_out,
        partial_stats,
        q,
        k_cache,
        v_cache,
        token_slots,
        token_positions,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        heads,
        max_splits,
        heads // kv_heads,
        head_dim,
        window,
        scale,
        SPLIT_KEYS=split_keys,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    _combine_kernel[(tokens, heads)](
        out,
        partial_out,
        partial_stats,
        token_positions,
        out.stride(0),
        out.stride(1),
        heads,
        max_splits,
        head_dim,
        window,
        SPLIT_KEYS=split_keys,
        BLOCK_D=block_d,
    )
    return out
