"""Plain-PyTorch verification of a token tree: the reference the Triton kernel is tested against.

A tree row holds nodes 0 .. num_nodes - 1 in an order where every parent comes before its
children: node 0 is the root (the last verified token), node c (c >= 1) a draft token whose
parent is parents[c]. Siblings are tried in index order. After node n the target's
distribution of the next token is target_probs[n]; the draft's is the sparse q[n], from which
n's children were drawn independently (with replacement).

The sampled rule (multi-candidate speculative sampling; Miao et al. 2023, SpecInfer,
https://arxiv.org/abs/2305.09781, Theorem 4.2): at the current node, with p its target
distribution, each child x in turn is accepted with probability min(1, p(x) / q(x)); a
rejected child replaces p with norm(max(0, p - q)) for the siblings after it. An accepted
child becomes the current node (p its own target distribution). When no child of the
current node is kept, the next token is drawn from p as it then is: the residual after the
rejections, or the target's own distribution when there were none. With the children drawn
i.i.d. from q, every token then follows the target exactly.

p is kept unnormalised as weights w with mass Z (w / Z is the distribution): a rejection sets
w' = max(0, w - Z q) and Z' = Z - sum_s min(w_s, Z q_s) over q's support, summed slot by slot
in order; a child x is accepted when u * q(x) * Z < w(x). Only q's support changes, so w is
held on it (residual [batch, support]) beside the target's row. No sum over the vocabulary is
taken, which keeps the Triton kernel bit-equal to this reference. Tokens are drawn by the
exponential race argmax(w / E), as in rejection_reference.py, with E per depth.

The greedy rule: a child is kept when its token is the argmax of its parent's logits (the
first such child); the next token is the argmax at the last node kept.

Outputs: output_token_ids [batch, d_max + 1] (the kept tokens, then the next token, -1 after),
num_accepted [batch] (the depth reached) and path [batch, d_max] (the nodes kept, -1 after),
where d_max is exponentials.shape[1] - 1 (sampled) or the deepest node's depth (greedy).
"""

from __future__ import annotations

import torch


def tree_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Depth of every node [batch, n_max] (root 0; padding -1)."""
    batch, n_max = parents.shape
    depths = torch.full_like(parents, -1)
    depths[:, 0] = 0
    for c in range(1, n_max):
        present = c < num_nodes
        parent_depth = depths.gather(1, parents[:, c : c + 1].clamp(min=0))[:, 0]
        depths[:, c] = torch.where(present, parent_depth + 1, -1)
    return depths


def tree_rejection_sample_reference(
    target_probs: torch.Tensor,  # [batch, n_max, vocab] float32, p after each node
    parents: torch.Tensor,  # [batch, n_max] int64, parents[:, 0] = -1
    tokens: torch.Tensor,  # [batch, n_max] int64 (the root's is not read)
    num_nodes: torch.Tensor,  # [batch] int64, >= 1
    q_ids: torch.Tensor,  # [batch, n_max, support] int64, -1 padded: q after each node
    q_probs: torch.Tensor,  # [batch, n_max, support] float32, 0 padded
    uniforms: torch.Tensor,  # [batch, n_max] float32 in [0, 1): the test of node c
    exponentials: torch.Tensor,  # [batch, d_max + 1, vocab] float32 > 0: the draw at each depth
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids, num_accepted, path); see the module docstring."""
    batch, n_max, vocab = target_probs.shape
    d_max = exponentials.shape[1] - 1
    rows = torch.arange(batch, device=target_probs.device)
    current = torch.zeros(batch, dtype=torch.int64, device=target_probs.device)
    depth = torch.zeros_like(current)
    mass = torch.ones(batch, dtype=torch.float32, device=target_probs.device)  # Z
    residual = _support_weights(target_probs, q_ids, current)  # w on q(current)'s support
    output = torch.full((batch, d_max + 1), -1, dtype=torch.int64, device=target_probs.device)
    path = torch.full((batch, d_max), -1, dtype=torch.int64, device=target_probs.device)
    for c in range(1, n_max):
        tried = (c < num_nodes) & (parents[:, c] == current)
        if not bool(tried.any()):  # a node off every row's walk changes nothing (and costs a loop)
            continue
        ids, probs = q_ids[rows, current], q_probs[rows, current]  # [batch, support]
        token = tokens[:, c]
        hits = ids == token[:, None]
        q_token = torch.where(hits, probs, 0.0).sum(1)  # one hit at most: exact
        in_support = hits.any(1)
        w_token = torch.where(in_support, torch.where(hits, residual, 0.0).sum(1), target_probs[rows, current, token])
        accepted = tried & (uniforms[:, c] * q_token * mass < w_token)
        rejected = tried & ~accepted
        # A rejection: w' = max(0, w - Z q), Z' = Z - sum_s min(w_s, Z q_s), slot by slot.
        scaled = mass[:, None] * probs
        new_mass = mass.clone()
        for s in range(ids.shape[1]):
            new_mass = new_mass - torch.minimum(residual[:, s], scaled[:, s])
        mass = torch.where(rejected, new_mass, mass)
        residual = torch.where(rejected[:, None], torch.clamp(residual - scaled, min=0.0), residual)
        # An acceptance: the child becomes the current node, with its own p.
        keep = accepted & (depth < d_max)
        slot = depth.clamp(max=max(d_max - 1, 0))
        if d_max > 0:
            path[rows, slot] = torch.where(keep, c, path[rows, slot])
            output[rows, slot] = torch.where(keep, token, output[rows, slot])
        current = torch.where(keep, c, current)
        depth = depth + keep.long()
        mass = torch.where(keep, torch.ones_like(mass), mass)
        residual = torch.where(keep[:, None], _support_weights(target_probs, q_ids, current), residual)
    next_token = _draw(target_probs[rows, current], q_ids[rows, current], residual, exponentials[rows, depth])
    output[rows, depth] = next_token
    return output, depth, path


def tree_greedy_verify_reference(
    target_logits: torch.Tensor,  # [batch, n_max, vocab] float32
    parents: torch.Tensor,  # [batch, n_max] int64
    tokens: torch.Tensor,  # [batch, n_max] int64
    num_nodes: torch.Tensor,  # [batch] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy rule; returns (output_token_ids, num_accepted, path) as the sampled one, with
    d_max the deepest node's depth."""
    batch, n_max, _ = target_logits.shape
    depths = tree_depths(parents, num_nodes)
    d_max = max(int(depths.max()), 0)
    best = target_logits.argmax(-1)  # [batch, n_max]
    rows = torch.arange(batch, device=target_logits.device)
    current = torch.zeros(batch, dtype=torch.int64, device=target_logits.device)
    depth = torch.zeros_like(current)
    output = torch.full((batch, d_max + 1), -1, dtype=torch.int64, device=target_logits.device)
    path = torch.full((batch, d_max), -1, dtype=torch.int64, device=target_logits.device)
    for c in range(1, n_max):
        keep = (c < num_nodes) & (parents[:, c] == current) & (tokens[:, c] == best[rows, current])
        slot = depth.clamp(max=max(d_max - 1, 0))
        path[rows, slot] = torch.where(keep, c, path[rows, slot])
        output[rows, slot] = torch.where(keep, tokens[:, c], output[rows, slot])
        current = torch.where(keep, c, current)
        depth = depth + keep.long()
    output[rows, depth] = best[rows, current]
    return output, depth, path


def _support_weights(target_probs: torch.Tensor, q_ids: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """p[node] at the ids of q[node]'s support [batch, support] (0 on padding)."""
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    ids = q_ids[rows, nodes]
    weights = target_probs[rows, nodes].gather(1, ids.clamp(min=0))
    return torch.where(ids >= 0, weights, 0.0)


def _draw(p: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The next token from w (p with the support's entries replaced by residual), by the
    exponential race; from p where w has no mass left (p and q equal up to rounding)."""
    weights = p.clone()
    rows, slots = (ids >= 0).nonzero(as_tuple=True)
    weights[rows, ids[rows, slots]] = residual[rows, slots]  # a support's ids are distinct
    from_residual = torch.argmax(weights / noise, dim=1)
    from_p = torch.argmax(p / noise, dim=1)
    return torch.where(weights.amax(1) > 0, from_residual, from_p)
