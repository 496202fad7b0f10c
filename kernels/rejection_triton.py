"""Triton rejection-sampling kernels; same signatures and results as rejection_reference.py.

One program per batch row. The accept test is vectorised over the row's draft positions; the
recovered or bonus token then needs a single pass over the vocabulary at the first rejected
position, reading the sparse q of that position straight from its (ids, probs) support.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Vocabulary tile of the argmax passes. Fixed rather than tuned: large enough that a
# 128k-token vocabulary takes ~128 loop trips, small enough to stay in registers with the
# [K_BLOCK, V_BLOCK] tile of the greedy kernel.
VOCAB_BLOCK = 1024


@triton.jit
def _rejection_sample_kernel(
    output_ptr,  # [batch, k_max + 1] int64, written
    num_accepted_ptr,  # [batch] int64, written
    target_probs_ptr,  # [batch, k_max + 1, vocab] float32
    draft_ids_ptr,  # [batch, k_max] int64
    num_draft_ptr,  # [batch] int64
    q_ids_ptr,  # [batch, k_max, support] int64
    q_probs_ptr,  # [batch, k_max, support] float32
    uniforms_ptr,  # [batch, k_max] float32
    exponentials_ptr,  # [batch, k_max + 1, vocab] float32
    k_max,
    vocab,
    support,
    K_BLOCK: tl.constexpr,  # power of two >= k_max + 1: tl.arange needs a power of two
    S_BLOCK: tl.constexpr,  # power of two >= support
    V_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row)
    ks = tl.arange(0, K_BLOCK).to(tl.int64)
    ss = tl.arange(0, S_BLOCK).to(tl.int64)
    is_draft = ks < num_draft

    drafts = tl.load(draft_ids_ptr + row * k_max + ks, mask=is_draft, other=0)
    p_draft = tl.load(target_probs_ptr + (row * (k_max + 1) + ks) * vocab + drafts, mask=is_draft, other=0.0)
    q_mask = is_draft[:, None] & (ss[None, :] < support)
    q_offsets = (row * k_max + ks[:, None]) * support + ss[None, :]
    q_ids = tl.load(q_ids_ptr + q_offsets, mask=q_mask, other=-1)  # [K_BLOCK, S_BLOCK]
    q_probs = tl.load(q_probs_ptr + q_offsets, mask=q_mask, other=0.0)
    q_draft = tl.sum(tl.where(q_ids == drafts[:, None], q_probs, 0.0), axis=1)  # one hit: exact
    uniforms = tl.load(uniforms_ptr + row * k_max + ks, mask=is_draft, other=0.0)
    rejected = is_draft & ~(uniforms * q_draft < p_draft)
    num_accepted = tl.min(tl.where(rejected, ks, num_draft), axis=0)
    is_rejection = num_accepted < num_draft

    # Support of q at the first rejected position (empty when there is none).
    j_mask = ss < tl.where(is_rejection, support, 0)
    j_offsets = (row * k_max + num_accepted) * support + ss
    q_ids_j = tl.load(q_ids_ptr + j_offsets, mask=j_mask, other=-1)  # [S_BLOCK]
    q_probs_j = tl.load(q_probs_ptr + j_offsets, mask=j_mask, other=0.0)

    base = (row * (k_max + 1) + num_accepted) * vocab
    best_residual = -1.0
    best_residual_id = 0
    best_p = -1.0
    best_p_id = 0
    residual_max = 0.0
    for start in range(0, vocab, V_BLOCK):
        vs = start + tl.arange(0, V_BLOCK).to(tl.int64)
        in_vocab = vs < vocab
        p = tl.load(target_probs_ptr + base + vs, mask=in_vocab, other=0.0)
        noise = tl.load(exponentials_ptr + base + vs, mask=in_vocab, other=1.0)
        q = tl.sum(tl.where(q_ids_j[None, :] == vs[:, None], q_probs_j[None, :], 0.0), axis=1)
        residual = tl.maximum(p - q, 0.0)
        residual_max = tl.maximum(residual_max, tl.max(residual, axis=0))
        # -1 on padding lanes: every real score is >= 0, so padding never wins.
        residual_score = tl.where(in_vocab, residual / noise, -1.0)
        p_score = tl.where(in_vocab, p / noise, -1.0)
        best_residual, best_residual_id = first_max(residual_score, start, best_residual, best_residual_id)
        best_p, best_p_id = first_max(p_score, start, best_p, best_p_id)

    next_token = tl.where(is_rejection & (residual_max > 0.0), best_residual_id, best_p_id)
    _store_row(output_ptr, num_accepted_ptr, row, k_max, ks, drafts, num_accepted, next_token)


@triton.jit
def first_max(scores, start, best, best_id):
    """The running (max, first index) over vocabulary tiles, updated with the tile of scores
    that starts at start. Strictly greater: an earlier tile keeps ties, so the result is the
    first argmax, as torch.argmax's."""
    block_best, block_id = tl.max(scores, axis=0, return_indices=True)
    if block_best > best:
        best = block_best
        best_id = start + block_id
    return best, best_id


@triton.jit
def _greedy_verify_kernel(
    output_ptr,  # [batch, k_max + 1] int64, written
    num_accepted_ptr,  # [batch] int64, written
    target_logits_ptr,  # [batch, k_max + 1, vocab] float32
    draft_ids_ptr,  # [batch, k_max] int64
    num_draft_ptr,  # [batch] int64
    k_max,
    vocab,
    K_BLOCK: tl.constexpr,  # power of two >= k_max + 1
    V_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row)
    ks = tl.arange(0, K_BLOCK).to(tl.int64)
    is_scored = ks <= num_draft  # positions 1 .. K+1 of the row
    best = tl.full([K_BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([K_BLOCK], tl.int64)
    for start in range(0, vocab, V_BLOCK):
        vs = start + tl.arange(0, V_BLOCK).to(tl.int64)
        mask = is_scored[:, None] & (vs[None, :] < vocab)
        offsets = (row * (k_max + 1) + ks[:, None]) * vocab + vs[None, :]
        logits = tl.load(target_logits_ptr + offsets, mask=mask, other=float("-inf"))  # [K_BLOCK, V_BLOCK]
        block_best, block_id = tl.max(logits, axis=1, return_indices=True)
        better = block_best > best  # strictly: earlier tiles keep ties
        best = tl.where(better, block_best, best)
        best_id = tl.where(better, start + block_id, best_id)

    is_draft = ks < num_draft
    drafts = tl.load(draft_ids_ptr + row * k_max + ks, mask=is_draft, other=0)
    mismatch = is_draft & (drafts != best_id)
    num_accepted = tl.min(tl.where(mismatch, ks, num_draft), axis=0)
    next_token = tl.sum(tl.where(ks == num_accepted, best_id, 0), axis=0)
    _store_row(output_ptr, num_accepted_ptr, row, k_max, ks, drafts, num_accepted, next_token)


@triton.jit
def _store_row(output_ptr, num_accepted_ptr, row, k_max, ks, drafts, num_accepted, next_token):
    out = tl.where(ks < num_accepted, drafts, tl.where(ks == num_accepted, next_token, -1))
    tl.store(output_ptr + row * (k_max + 1) + ks, out, mask=ks < k_max + 1)
    tl.store(num_accepted_ptr + row, num_accepted)


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab] float32
    draft_token_ids: torch.Tensor,  # [batch, k_max] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64
    draft_q_ids: torch.Tensor,  # [batch, k_max, support] int64
    draft_q_probs: torch.Tensor,  # [batch, k_max, support] float32
    uniforms: torch.Tensor,  # [batch, k_max] float32
    exponentials: torch.Tensor,  # [batch, k_max + 1, vocab] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k_max = draft_token_ids.shape
    vocab = target_probs.shape[2]
    support = draft_q_ids.shape[2]
    _check(target_probs, (batch, k_max + 1, vocab), torch.float32, "target_probs")
    _check(draft_token_ids, (batch, k_max), torch.int64, "draft_token_ids")
    _check(num_draft_tokens, (batch,), torch.int64, "num_draft_tokens")
    _check(draft_q_ids, (batch, k_max, support), torch.int64, "draft_q_ids")
    _check(draft_q_probs, (batch, k_max, support), torch.float32, "draft_q_probs")
    _check(uniforms, (batch, k_max), torch.float32, "uniforms")
    _check(exponentials, (batch, k_max + 1, vocab), torch.float32, "exponentials")
    output, num_accepted = _outputs(draft_token_ids)
    if batch == 0:
        return output, num_accepted
    _rejection_sample_kernel[(batch,)](
        output,
        num_accepted,
        target_probs,
        draft_token_ids,
        num_draft_tokens,
        draft_q_ids,
        draft_q_probs,
        uniforms,
        exponentials,
        k_max,
        vocab,
        support,
        K_BLOCK=_pow2(k_max + 1),
        S_BLOCK=_pow2(support),
        V_BLOCK=VOCAB_BLOCK,
    )
    return output, num_accepted


def greedy_verify_triton(
    target_logits: torch.Tensor,  # [batch, k_max + 1, vocab] float32
    draft_token_ids: torch.Tensor,  # [batch, k_max] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k_max = draft_token_ids.shape
    vocab = target_logits.shape[2]
    _check(target_logits, (batch, k_max + 1, vocab), torch.float32, "target_logits")
    _check(draft_token_ids, (batch, k_max), torch.int64, "draft_token_ids")
    _check(num_draft_tokens, (batch,), torch.int64, "num_draft_tokens")
    output, num_accepted = _outputs(draft_token_ids)
    if batch == 0:
        return output, num_accepted
    _greedy_verify_kernel[(batch,)](
        output,
        num_accepted,
        target_logits,
        draft_token_ids,
        num_draft_tokens,
        k_max,
        vocab,
        K_BLOCK=_pow2(k_max + 1),
        V_BLOCK=VOCAB_BLOCK,
    )
    return output, num_accepted


def _check(tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    assert tuple(tensor.shape) == shape, f"{name}: shape {tuple(tensor.shape)}, expected {shape}"
    assert tensor.dtype == dtype, f"{name}: dtype {tensor.dtype}, expected {dtype}"
    assert tensor.is_contiguous(), f"{name} must be contiguous"


def _outputs(draft_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k_max = draft_token_ids.shape
    output = torch.empty(batch, k_max + 1, dtype=torch.int64, device=draft_token_ids.device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=draft_token_ids.device)
    return output, num_accepted


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))
