"""Entry points of the verifier: the Triton kernel on CUDA, the reference on the CPU."""

from __future__ import annotations

import torch

from specserve_kernels.rejection_reference import greedy_verify_reference, rejection_sample_reference


def rejection_sample(
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab] float32
    draft_token_ids: torch.Tensor,  # [batch, k_max] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64
    draft_q_ids: torch.Tensor,  # [batch, k_max, support] int64
    draft_q_probs: torch.Tensor,  # [batch, k_max, support] float32
    uniforms: torch.Tensor,  # [batch, k_max] float32
    exponentials: torch.Tensor,  # [batch, k_max + 1, vocab] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [batch, k_max + 1], num_accepted [batch]); see the reference."""
    args = (target_probs, draft_token_ids, num_draft_tokens, draft_q_ids, draft_q_probs, uniforms, exponentials)
    if target_probs.is_cuda:
        from specserve_kernels.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(*args)
    return rejection_sample_reference(*args)


def greedy_verify(
    target_logits: torch.Tensor,  # [batch, k_max + 1, vocab] float32
    draft_token_ids: torch.Tensor,  # [batch, k_max] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [batch, k_max + 1], num_accepted [batch]); see the reference."""
    if target_logits.is_cuda:
        from specserve_kernels.rejection_triton import greedy_verify_triton

        return greedy_verify_triton(target_logits, draft_token_ids, num_draft_tokens)
    return greedy_verify_reference(target_logits, draft_token_ids, num_draft_tokens)
