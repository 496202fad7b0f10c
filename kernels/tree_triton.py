"""Triton kernel of the sampled tree rule; same signature and results as
tree_reference.tree_rejection_sample_reference (bit-equal on a CPU under the interpreter).

One program per tree row. It walks the nodes in order with scalar control flow (a child is
tried only while its parent is the current node), holds the residual on q's support in
registers, and makes one pass over the vocabulary at the end for the next token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels.rejection_triton import first_max

VOCAB_BLOCK = 1024


@triton.jit
def _tree_rejection_sample_kernel(
    output_ptr,  # [batch, d_max + 1] int64, -1 filled; written
    num_accepted_ptr,  # [batch] int64, written
    path_ptr,  # [batch, d_max] int64, -1 filled; written
    target_probs_ptr,  # [batch, n_max, vocab] float32
    parents_ptr,  # [batch, n_max] int64
    tokens_ptr,  # [batch, n_max] int64
    num_nodes_ptr,  # [batch] int64
    q_ids_ptr,  # [batch, n_max, support] int64
    q_probs_ptr,  # [batch, n_max, support] float32
    uniforms_ptr,  # [batch, n_max] float32
    exponentials_ptr,  # [batch, d_max + 1, vocab] float32
    n_max,
    d_max,
    vocab,
    support,
    S_BLOCK: tl.constexpr,  # power of two >= support
    V_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_nodes = tl.load(num_nodes_ptr + row)
    ss = tl.arange(0, S_BLOCK).to(tl.int64)
    in_support = ss < support
    current = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int64)
    mass = tl.full([], 1.0, tl.float32)
    ids = tl.load(q_ids_ptr + (row * n_max + current) * support + ss, mask=in_support, other=-1)
    probs = tl.load(q_probs_ptr + (row * n_max + current) * support + ss, mask=in_support, other=0.0)
    residual = tl.load(
        target_probs_ptr + (row * n_max + current) * vocab + tl.maximum(ids, 0), mask=ids >= 0, other=0.0
    )
    for c in range(1, num_nodes):
        parent = tl.load(parents_ptr + row * n_max + c)
        if parent == current:
            token = tl.load(tokens_ptr + row * n_max + c)
            hits = ids == token
            q_token = tl.sum(tl.where(hits, probs, 0.0), axis=0)  # one hit at most: exact
            hit = tl.max(hits.to(tl.int32), axis=0) > 0
            w_support = tl.sum(tl.where(hits, residual, 0.0), axis=0)
            w_target = tl.load(target_probs_ptr + (row * n_max + current) * vocab + token)
            w_token = tl.where(hit, w_support, w_target)
            u = tl.load(uniforms_ptr + row * n_max + c)
            if u * q_token * mass < w_token:
                if depth < d_max:
                    tl.store(path_ptr + row * d_max + depth, c)
                    tl.store(output_ptr + row * (d_max + 1) + depth, token)
                    current = c + tl.zeros([], tl.int64)
                    depth += 1
                    mass = tl.full([], 1.0, tl.float32)
                    ids = tl.load(q_ids_ptr + (row * n_max + current) * support + ss, mask=in_support, other=-1)
                    probs = tl.load(q_probs_ptr + (row * n_max + current) * support + ss, mask=in_support, other=0.0)
                    residual = tl.load(
                        target_probs_ptr + (row * n_max + current) * vocab + tl.maximum(ids, 0),
                        mask=ids >= 0,
                        other=0.0,
                    )
            else:
                # w' = max(0, w - Z q); Z' = Z - sum_s min(w_s, Z q_s), slot by slot in order.
                scaled = mass * probs
                new_mass = mass
                for s in range(0, support):
                    w_s = tl.sum(tl.where(ss == s, residual, 0.0), axis=0)
                    zq_s = tl.sum(tl.where(ss == s, scaled, 0.0), axis=0)
                    new_mass = new_mass - tl.minimum(w_s, zq_s)
                mass = new_mass
                residual = tl.maximum(residual - scaled, 0.0)

    # The next token: argmax over the vocabulary of w / E (w: p with the support's entries
    # replaced by the residual), or of p / E where w has no mass left.
    base = (row * n_max + current) * vocab
    noise_base = (row * (d_max + 1) + depth) * vocab
    best_w = -1.0
    best_w_id = 0
    best_p = -1.0
    best_p_id = 0
    w_max = 0.0
    for start in range(0, vocab, V_BLOCK):
        vs = start + tl.arange(0, V_BLOCK).to(tl.int64)
        in_vocab = vs < vocab
        p = tl.load(target_probs_ptr + base + vs, mask=in_vocab, other=0.0)
        noise = tl.load(exponentials_ptr + noise_base + vs, mask=in_vocab, other=1.0)
        matches = ids[None, :] == vs[:, None]  # [V_BLOCK, S_BLOCK]
        replaced = tl.max(matches.to(tl.int32), axis=1) > 0
        w = tl.where(replaced, tl.sum(tl.where(matches, residual[None, :], 0.0), axis=1), p)
        w_max = tl.maximum(w_max, tl.max(tl.where(in_vocab, w, 0.0), axis=0))
        w_score = tl.where(in_vocab, w / noise, -1.0)  # -1 on padding: real scores are >= 0
        p_score = tl.where(in_vocab, p / noise, -1.0)
        best_w, best_w_id = first_max(w_score, start, best_w, best_w_id)
        best_p, best_p_id = first_max(p_score, start, best_p, best_p_id)
    next_token = tl.where(w_max > 0.0, best_w_id, best_p_id)
    tl.store(output_ptr + row * (d_max + 1) + depth, next_token)
    tl.store(num_accepted_ptr + row, depth)


def tree_rejection_sample_triton(
    target_probs: torch.Tensor,  # [batch, n_max, vocab] float32
    parents: torch.Tensor,  # [batch, n_max] int64
    tokens: torch.Tensor,  # [batch, n_max] int64
    num_nodes: torch.Tensor,  # [batch] int64
    q_ids: torch.Tensor,  # [batch, n_max, support] int64
    q_probs: torch.Tensor,  # [batch, n_max, support] float32
    uniforms: torch.Tensor,  # [batch, n_max] float32
    exponentials: torch.Tensor,  # [batch, d_max + 1, vocab] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, n_max, vocab = target_probs.shape
    support, d_max = q_ids.shape[2], exponentials.shape[1] - 1
    for tensor, shape, dtype, name in (
        (target_probs, (batch, n_max, vocab), torch.float32, "target_probs"),
        (parents, (batch, n_max), torch.int64, "parents"),
        (tokens, (batch, n_max), torch.int64, "tokens"),
        (num_nodes, (batch,), torch.int64, "num_nodes"),
        (q_ids, (batch, n_max, support), torch.int64, "q_ids"),
        (q_probs, (batch, n_max, support), torch.float32, "q_probs"),
        (uniforms, (batch, n_max), torch.float32, "uniforms"),
        (exponentials, (batch, d_max + 1, vocab), torch.float32, "exponentials"),
    ):
        assert tuple(tensor.shape) == shape, f"{name}: shape {tuple(tensor.shape)}, expected {shape}"
        assert tensor.dtype == dtype and tensor.is_contiguous(), f"{name}: {dtype}, contiguous"
    device = target_probs.device
    output = torch.full((batch, d_max + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    path = torch.full((batch, d_max), -1, dtype=torch.int64, device=device)
    if batch == 0:
        return output, num_accepted, path
    _tree_rejection_sample_kernel[(batch,)](
        output,
        num_accepted,
        path,
        target_probs,
        parents,
        tokens,
        num_nodes,
        q_ids,
        q_probs,
        uniforms,
        exponentials,
        n_max,
        d_max,
        vocab,
        support,
        S_BLOCK=max(2, triton.next_power_of_2(support)),
        V_BLOCK=VOCAB_BLOCK,
    )
    return output, num_accepted, path
