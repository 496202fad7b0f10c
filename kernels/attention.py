"""Exact attention for the runner: the Triton kernel on CUDA, the reference on the CPU."""

from __future__ import annotations

import logging

import torch

from specserve_kernels.attention_reference import exact_attention_reference

log = logging.getLogger(__name__)


def exact_attention(
    q: torch.Tensor,  # [T, heads, d], rotated
    k_cache: torch.Tensor,  # [slots, kv_heads, max_len, d]
    v_cache: torch.Tensor,  # [slots, kv_heads, max_len, d]
    token_slots: torch.Tensor,  # [T] int64
    token_positions: torch.Tensor,  # [T] int64
    window: int | None,
    scale: float,
    max_keys: int | None = None,  # >= every position + 1, where the caller knows it
) -> torch.Tensor:
    """Returns [T, heads, d]: each query against exactly its own keys; see the reference."""
    args = (q, k_cache, v_cache, token_slots, token_positions, window, scale)
    if q.is_cuda:
        from specserve_kernels.attention_triton import exact_attention_triton

        return exact_attention_triton(*args, max_keys)
    return exact_attention_reference(*args)


def triton_kernel_works(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> bool:
    """Whether the Triton kernel builds for a model of these shapes and agrees with the
    reference on this device: a runner checks it at load and falls back to the reference
    where it does not."""
    generator = torch.Generator().manual_seed(0)
    # 200 keys: several key blocks, so the online softmax's rescaling between blocks is checked.
    caches = [torch.randn(2, kv_heads, 200, head_dim, generator=generator).to(device, dtype) for _ in range(2)]
    q = torch.randn(5, heads, head_dim, generator=generator).to(device, dtype)
    slots, positions = torch.tensor([0, 1, 1, 0, 1], device=device), torch.tensor([199, 0, 77, 5, 150], device=device)
    scale = head_dim**-0.5
    try:
        from specserve_kernels.attention_triton import exact_attention_triton

        actual = exact_attention_triton(q, *caches, slots, positions, window, scale)
    except Exception:  # no Triton, or a compiler or driver error: this device cannot run the kernel
        log.exception("the Triton exact-attention kernel failed on %s", device)
        return False
    expected = exact_attention_reference(q.float(), *(c.float() for c in caches), slots, positions, window, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    return torch.allclose(actual.float(), expected, atol=tolerance, rtol=tolerance)
