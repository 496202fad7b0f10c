"""Plain-PyTorch rejection sampling: the reference every Triton kernel is tested against.

The rule (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192; Chen et al. 2023,
https://arxiv.org/abs/2302.01318): draft token d_i, drawn from q_i, is accepted when
u_i * q_i(d_i) < p_i(d_i), i.e. with probability min(1, p_i(d_i) / q_i(d_i)). At the first
rejection j the *recovered* token is drawn from norm(max(0, p_j - q_j)); when all drafts are
accepted the *bonus* token is drawn from p_{K+1}. Tokens are drawn by the exponential race,
argmax_v(w_v / E_v) with E_v ~ Exp(1), which picks v with probability w_v / sum(w) and needs
no normalisation; the caller supplies u and E so that randomness stays keyed by position.

Padding conventions shared with the Triton kernels: rows hold num_draft_tokens[b] <= k_max
drafts; sparse q supports are padded with id -1 and probability 0; output rows are padded
with -1 after the next token.
"""

from __future__ import annotations

import torch


def rejection_sample_reference(
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab] float32, p_1 .. p_{K+1}
    draft_token_ids: torch.Tensor,  # [batch, k_max] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64
    draft_q_ids: torch.Tensor,  # [batch, k_max, support] int64, -1 padded
    draft_q_probs: torch.Tensor,  # [batch, k_max, support] float32, 0 padded
    uniforms: torch.Tensor,  # [batch, k_max] float32 in [0, 1)
    exponentials: torch.Tensor,  # [batch, k_max + 1, vocab] float32 > 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [batch, k_max + 1] int64, num_accepted [batch] int64)."""
    batch, k_max = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    positions = torch.arange(k_max, device=target_probs.device)
    is_draft = positions[None, :] < num_draft_tokens[:, None]  # [batch, k_max]
    safe_drafts = torch.where(is_draft, draft_token_ids, 0)

    p_draft = target_probs[:, :k_max].gather(2, safe_drafts[..., None])[..., 0]  # [batch, k_max]
    q_draft = _sparse_prob_of(draft_q_ids, draft_q_probs, safe_drafts)  # [batch, k_max]
    rejected = is_draft & ~(uniforms * q_draft < p_draft)
    num_accepted = _first_true(rejected, num_draft_tokens)  # [batch]

    p_next = target_probs[rows, num_accepted]  # [batch, vocab]
    noise = exponentials[rows, num_accepted]  # [batch, vocab]
    is_rejection = num_accepted < num_draft_tokens  # [batch]
    q_next = _dense_q_at(draft_q_ids, draft_q_probs, num_accepted, is_rejection, p_next.shape[1])
    residual = torch.clamp(p_next - q_next, min=0.0)  # [batch, vocab]
    recovered = torch.argmax(residual / noise, dim=1)
    bonus = torch.argmax(p_next / noise, dim=1)
    # A residual with no mass left (p == q up to rounding) cannot be normalised; p is then
    # the distribution the recovered token must follow.
    use_residual = is_rejection & (residual.amax(1) > 0)
    next_token = torch.where(use_residual, recovered, bonus)
    return _assemble(draft_token_ids, num_accepted, next_token), num_accepted


def greedy_verify_reference(
    target_logits: torch.Tensor,  # [batch, k_max + 1, vocab] float32
    draft_token_ids: torch.Tensor,  # [batch, k_max] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rule: accept while d_i == argmax p_i; the next token is argmax p_j."""
    batch, k_max = draft_token_ids.shape
    rows = torch.arange(batch, device=target_logits.device)
    positions = torch.arange(k_max, device=target_logits.device)
    target_argmax = torch.argmax(target_logits, dim=2)  # [batch, k_max + 1]
    is_draft = positions[None, :] < num_draft_tokens[:, None]
    mismatch = is_draft & (draft_token_ids != target_argmax[:, :k_max])
    num_accepted = _first_true(mismatch, num_draft_tokens)
    next_token = target_argmax[rows, num_accepted]
    return _assemble(draft_token_ids, num_accepted, next_token), num_accepted


def _first_true(flags: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row of flags [batch, k], or default[b] when none is."""
    if flags.shape[1] == 0:
        return default.clone()
    positions = torch.arange(flags.shape[1], device=flags.device)
    return torch.where(flags, positions[None, :], default[:, None]).amin(1)


def _sparse_prob_of(q_ids: torch.Tensor, q_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """q(token) for each [batch, k] position from its sparse support (0 if not in it)."""
    hits = q_ids == tokens[..., None]  # [batch, k_max, support]
    return torch.where(hits, q_probs, 0.0).sum(-1)  # at most one hit: the sum is exact


def _dense_q_at(
    q_ids: torch.Tensor, q_probs: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Dense q at draft position index[b] for rows where keep[b], zeros elsewhere: [batch, vocab]."""
    batch, k_max, support = q_ids.shape
    dense = torch.zeros(batch, vocab, dtype=q_probs.dtype, device=q_probs.device)
    if k_max == 0 or support == 0:
        return dense
    rows = torch.arange(batch, device=q_ids.device)
    safe_index = index.clamp(max=k_max - 1)
    ids = q_ids[rows, safe_index]  # [batch, support]
    valid = keep[:, None] & (ids >= 0)
    probs = torch.where(valid, q_probs[rows, safe_index], 0.0)
    # scatter_add onto zeros keeps each (distinct) probability exact; padding adds 0 to id 0.
    return dense.scatter_add_(1, torch.where(valid, ids, 0), probs)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[batch, k_max + 1]: accepted drafts, then the next token, then -1 padding."""
    batch, k_max = draft_token_ids.shape
    slots = torch.arange(k_max + 1, device=draft_token_ids.device)[None, :]
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    out = torch.where(slots < num_accepted[:, None], padded_drafts, -1)
    return torch.where(slots == num_accepted[:, None], next_token[:, None], out)
