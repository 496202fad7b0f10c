"""Entry points of a token tree's verification: the Triton kernel on CUDA, the reference on
the CPU (see tree_reference.py for the rule and the tensors)."""

from __future__ import annotations

import torch

from specserve_kernels.tree_reference import tree_greedy_verify_reference, tree_rejection_sample_reference


def tree_rejection_sample(
    target_probs: torch.Tensor,  # [batch, n_max, vocab] float32
    parents: torch.Tensor,  # [batch, n_max] int64
    tokens: torch.Tensor,  # [batch, n_max] int64
    num_nodes: torch.Tensor,  # [batch] int64
    q_ids: torch.Tensor,  # [batch, n_max, support] int64
    q_probs: torch.Tensor,  # [batch, n_max, support] float32
    uniforms: torch.Tensor,  # [batch, n_max] float32
    exponentials: torch.Tensor,  # [batch, d_max + 1, vocab] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [batch, d_max + 1], num_accepted [batch], path [batch, d_max])."""
    args = (target_probs, parents, tokens, num_nodes, q_ids, q_probs, uniforms, exponentials)
    if target_probs.is_cuda:
        from specserve_kernels.tree_triton import tree_rejection_sample_triton

        return tree_rejection_sample_triton(*args)
    return tree_rejection_sample_reference(*args)


def tree_greedy_verify(
    target_logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, num_nodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy rule (one argmax per node and a walk, on any device)."""
    return tree_greedy_verify_reference(target_logits, parents, tokens, num_nodes)
