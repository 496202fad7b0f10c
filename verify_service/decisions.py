"""The round's decision, for every row of a batch at once: which drafts to keep and the token
after them (docs/design.md, "The round"). A row is the engine's: its drafts, their draft
distributions, the target's logits (and their argmax where the forward made it), its
sampling and the position of its first draft."""

from __future__ import annotations

import struct

import torch

from specserve.logprobs import token_logprobs
from specserve.methods.trees import depths
from specserve.sampling import (
    VERIFY_STREAM,
    draw_noise,
    exponential_noise,
    position_generator,
    processed_probs,
    tree_verify_uniforms,
    verify_noise,
)
from specserve_kernels.rejection import greedy_verify, rejection_sample
from specserve_kernels.tree import tree_rejection_sample
from verify_service.grammar_rounds import mask_logits, round_paths


def decide(rows: list, device: torch.device) -> list[tuple[int, int]]:
    """Each row's (drafts kept, next token): greedy rows by argmax, sampled ones by the
    rejection kernel, one call per sampling mode and per kind of row (chains, token trees,
    whose rows get the nodes kept as path)."""
    decisions: list[tuple[int, int]] = [(0, 0)] * len(rows)
    groups = {}
    for i, row in enumerate(rows):
        kind = (row.parents is not None, row.sampling.is_greedy)
        groups.setdefault(kind, []).append(i)
    deciders = {
        (False, True): decide_greedy,
        (False, False): decide_sampled,
        (True, True): decide_tree_greedy,
        (True, False): decide_tree_sampled,
    }
    for kind, group in groups.items():
        decide_group = deciders[kind]
        if group:
            for i in group:
                rows[i].batch_size = len(group)
            for i, decision in zip(group, decide_group([rows[i] for i in group], device)):
                decisions[i] = decision
    return decisions


def decide_greedy(rows: list, device: torch.device) -> list[tuple[int, int]]:
    """Accept while d_i == argmax p_i; the next token is the argmax after the last one
    kept. On CUDA the Triton kernel decides the batch on the device; elsewhere a walk in
    Python over the argmax the compiled forward made (or one argmax over every row's
    logits) does, where padding the rows for the reference kernel cost far more."""
    if rows[0].logits.is_cuda and any(row.drafts for row in rows):
        logits, drafts, num_draft = pad_rows(rows, [row.logits for row in rows], device)
        return unpack(*greedy_verify(logits, drafts, num_draft))
    if all(row.argmax is not None for row in rows):  # made by the compiled forward
        argmax = [token for row in rows for token in row.argmax]
    else:
        logits = rows[0].logits if len(rows) == 1 else torch.cat([row.logits for row in rows])
        argmax = logits.argmax(-1).tolist()  # [sum of K + 1]
    decisions, end = [], 0
    for row in rows:
        best, end = argmax[end : end + len(row.drafts) + 1], end + len(row.drafts) + 1
        kept = next((i for i, (d, b) in enumerate(zip(row.drafts, best)) if d != b), len(row.drafts))
        decisions.append((kept, best[kept]))
    return decisions


def decide_sampled(rows: list, device: torch.device) -> list[tuple[int, int]]:
    """The rejection rule: on CUDA the Triton kernel over the batch; on the CPU each row's
    accept tests at its drafts, then one draw at the position where they stop."""
    if not rows[0].logits.is_cuda:
        return [decide_sampled_row(row) for row in rows]
    probs = [processed_probs(row.logits, row.sampling) for row in rows]
    target_probs, drafts, num_draft = pad_rows(rows, probs, device)
    batch, k_max = drafts.shape
    vocab = target_probs.shape[2]
    support = max((len(d.token_ids) for row in rows for d in row.distributions), default=1)
    q_ids = torch.full((batch, k_max, support), -1, dtype=torch.long)  # [batch, k_max, support]
    q_probs = torch.zeros(batch, k_max, support)
    uniforms = torch.zeros(batch, k_max)  # [batch, k_max]
    noise = torch.ones(batch, k_max + 1, vocab, device=device)  # [batch, k_max + 1, vocab]
    for b, row in enumerate(rows):
        for i, distribution in enumerate(row.distributions):
            q_ids[b, i, : len(distribution.token_ids)] = torch.tensor(distribution.token_ids)
            q_probs[b, i, : len(distribution.probs)] = torch.tensor(distribution.probs)
        row_uniforms, row_noise = verify_noise(
            row.sampling.seed, row.first_position, len(row.drafts), k_max, vocab, device
        )
        uniforms[b] = row_uniforms.cpu()
        noise[b] = row_noise
    output, num_accepted = rejection_sample(
        target_probs,
        drafts,
        num_draft_tokens=num_draft,
        draft_q_ids=q_ids.to(device),
        draft_q_probs=q_probs.to(device),
        uniforms=uniforms.to(device),
        exponentials=noise,
    )
    return unpack(output, num_accepted)


def decide_sampled_row(row) -> tuple[int, int]:
    """One row's rejection rule as kernels/rejection_reference.py decides it, with the same
    arithmetic and randomness, but touching only what it needs: the target's probabilities
    at the drafts, the accept tests' uniforms up to the first rejection, and Exp(1) noise at
    one position, the first rejected one (the recovered token, from the residual) or the one
    after the last draft (the bonus token)."""
    probs = processed_probs(row.logits, row.sampling)  # [K + 1, vocab]
    k = len(row.drafts)
    seed, first = row.sampling.seed, row.first_position
    kept, generator = k, None
    if k:
        p_drafts = probs[torch.arange(k), torch.tensor(row.drafts, dtype=torch.long)].tolist()
        for i, (token, distribution, p) in enumerate(zip(row.drafts, row.distributions, p_drafts)):
            # The position's generator: its uniform first, then (where rejected) its noise.
            generator = position_generator(seed, first + i, VERIFY_STREAM, probs.device)
            u = float(torch.rand(1, generator=generator, device=probs.device)[0])
            if not _float32(u * _float32(distribution.prob_of(token))) < p:
                kept = i
                break
        else:
            generator = None
    weights = probs[kept]
    if kept < k:  # the residual max(0, p - q): q is sparse, so only its support changes
        distribution = row.distributions[kept]
        ids = torch.tensor(distribution.token_ids, dtype=torch.long)
        residual = weights.clone()
        residual[ids] = torch.clamp(weights[ids] - torch.tensor(distribution.probs, dtype=torch.float32), min=0.0)
        if bool(residual.amax() > 0):  # else p and q are equal up to rounding: draw from p
            weights = residual
    if generator is None:
        noise = draw_noise(seed, first + kept, weights.shape[0], weights.device)
    else:
        noise = exponential_noise(generator, weights.shape[0], weights.device)
    return kept, int(torch.argmax(weights / noise))


def _float32(value: float) -> float:
    """value rounded to float32, as the reference kernel holds q and its product u q."""
    return struct.unpack("f", struct.pack("f", value))[0]


def decide_tree_greedy(rows: list, device: torch.device) -> list[tuple[int, int]]:
    """From the root, the first child whose token is its parent's argmax, while there is one;
    the next token is the argmax at the last node kept."""
    decisions = []
    for row in rows:
        best = row.argmax if row.argmax is not None else row.logits.argmax(-1).tolist()
        current, row.path = 0, []
        for node in range(1, len(row.parents)):
            if row.parents[node] == current and row.feed[node] == best[current]:
                row.path.append(node)
                current = node
        decisions.append((len(row.path), best[current]))
    return decisions


def decide_tree_sampled(rows: list, device: torch.device) -> list[tuple[int, int]]:
    """The multi-candidate rule (kernels/tree_reference.py) over every row at once; each
    node's q is the distribution its children were drawn from."""
    n_max = max(len(row.parents) for row in rows)
    vocab = rows[0].logits.shape[1]
    support = max((len(d.token_ids) for row in rows for d in row.distributions), default=1)
    node_depths = [depths(row.parents) for row in rows]
    d_max = max(max(d) for d in node_depths)
    ranks = [_sibling_ranks(row.parents) for row in rows]
    siblings_max = max(max(r) for r in ranks) + 1
    target = torch.zeros(len(rows), n_max, vocab, device=device)
    parents = torch.full((len(rows), n_max), -1, dtype=torch.long)
    tokens = torch.zeros(len(rows), n_max, dtype=torch.long)
    q_ids = torch.full((len(rows), n_max, support), -1, dtype=torch.long)
    q_probs = torch.zeros(len(rows), n_max, support)
    uniforms = torch.zeros(len(rows), n_max)
    for b, row in enumerate(rows):
        n = len(row.parents)
        target[b, :n] = processed_probs(row.logits, row.sampling)
        parents[b, :n] = torch.tensor(row.parents)
        tokens[b, :n] = torch.tensor(row.feed)
        row_uniforms = tree_verify_uniforms(row.sampling.seed, row.first_position, d_max, siblings_max)
        for node in range(1, n):
            distribution, parent = row.distributions[node - 1], row.parents[node]
            q_ids[b, parent, : len(distribution.token_ids)] = torch.tensor(distribution.token_ids)
            q_probs[b, parent, : len(distribution.probs)] = torch.tensor(distribution.probs)
            uniforms[b, node] = row_uniforms[node_depths[b][parent], ranks[b][node]]
    num_nodes = torch.tensor([len(row.parents) for row in rows])
    args = [target, *(t.to(device) for t in (parents, tokens, num_nodes, q_ids, q_probs, uniforms))]
    # The walk does not read the noise: on the CPU it runs once without, and the noise is
    # drawn at the depth where each row's walk stopped (on CUDA drawing it all costs less).
    noise = torch.ones(len(rows), d_max + 1, vocab, device=device)
    depth_reached = [range(d_max + 1)] * len(rows)
    if not target.is_cuda:
        depth_reached = [[depth] for depth in tree_rejection_sample(*args, noise)[1].tolist()]
    for b, row in enumerate(rows):
        for depth in depth_reached[b]:
            noise[b, depth] = draw_noise(row.sampling.seed, row.first_position + depth, vocab, device)
    output, num_accepted, path = tree_rejection_sample(*args, noise)
    decisions = unpack(output, num_accepted)
    for row, nodes, (kept, _) in zip(rows, path.cpu().tolist(), decisions):
        row.path = nodes[:kept]
    return decisions


def _sibling_ranks(parents: list[int]) -> list[int]:
    """Each node's place among its parent's children (0: the first)."""
    seen: dict[int, int] = {}
    ranks = [0] * len(parents)
    for node in range(1, len(parents)):
        ranks[node] = seen.get(parents[node], 0)
        seen[parents[node]] = ranks[node] + 1
    return ranks


def pad_rows(
    rows: list, per_row: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacks rows of different K: ([batch, k_max + 1, vocab], drafts [batch, k_max], num_draft [batch])."""
    k_max = max(len(row.drafts) for row in rows)
    vocab = per_row[0].shape[1]
    scores = torch.zeros(len(rows), k_max + 1, vocab, device=device)
    drafts = torch.full((len(rows), k_max), -1, dtype=torch.long)
    for b, (row, values) in enumerate(zip(rows, per_row)):
        scores[b, : values.shape[0]] = values
        drafts[b, : len(row.drafts)] = torch.tensor(row.drafts, dtype=torch.long)
    num_draft = torch.tensor([len(row.drafts) for row in rows], dtype=torch.long)
    return scores, drafts.to(device), num_draft.to(device)


def unpack(output: torch.Tensor, num_accepted: torch.Tensor) -> list[tuple[int, int]]:
    output, num_accepted = output.cpu(), num_accepted.cpu()
    return [(int(n), int(output[b, n])) for b, n in enumerate(num_accepted.tolist())]


def logprobs_of(row, made: list[int]) -> dict:
    """A decided row's logprobs (Outcome fields), where its sampling asks for them: each token
    made (the accepted ones, then the next) from the logits of its position, a tree's path's
    nodes; and a prefill's prompt tokens', where asked, from the second on."""
    out = {}
    top = row.sampling.top_logprobs
    if row.sampling.logprobs:
        at = list(range(len(made))) if row.path is None else [0, *row.path][: len(made)]
        out["logprobs"] = tuple(token_logprobs(row.logits[at], made, top))
    if row.prompt_logprobs is not None:  # made in the forward (verify_service/scoring.py)
        out["prompt_logprobs"] = tuple(row.prompt_logprobs)
    return out


def stop_at_end_of_sequence(drafts: tuple[int, ...], num_accepted: int, next_token: int, eos: tuple) -> tuple[int, int]:
    """A round ends at an accepted end-of-sequence draft: it becomes the round's last token."""
    for i, token in enumerate(drafts[:num_accepted]):
        if token in eos:
            return i, token
    return num_accepted, next_token


def process_logits(row, eos: tuple[int, ...]) -> None:
    """Applies the row's logits processing (specserve/logit_processing.py), where its sampling
    asks, and its session's grammar (verify_service/grammar_rounds.py), where it has one: each
    row of its logits after the session's tokens and the round's tokens up to it (a chain's
    drafts before it, a tree node's path). The argmax the forward made goes: the decision
    takes the processed logits'."""
    processing, grammar = row.sampling.processing, row.session.grammar
    if not processing.active and grammar is None:
        return
    tokens = row.session.tokens
    prompt, output = tokens[: row.session.prompt_length], tokens[row.session.prompt_length :]
    added = round_paths(row, row.logits.shape[0])
    raw = row.logits
    if processing.active:
        row.logits = processing.apply(row.logits, prompt, output, added, eos)
    if grammar is not None:
        mask_logits(row, raw, added)
    row.argmax = None
