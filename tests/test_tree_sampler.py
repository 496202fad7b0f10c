"""A token tree's verification: the sampled rule is exact (chi-square against the target, for
trees with several siblings per node), a plausible wrong rule is caught by the same test, the
greedy rule keeps the longest path of argmaxes, and the Triton kernel gives the reference's
results bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from scipy import stats

from specserve_kernels.tree_reference import (
    tree_depths,
    tree_greedy_verify_reference,
    tree_rejection_sample_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 6


def _distribution(generator, vocab: int, zeros: int = 0) -> torch.Tensor:
    weights = torch.rand(vocab, generator=generator) + 0.05
    if zeros:
        weights[torch.randperm(vocab, generator=generator)[:zeros]] = 0.0
    return weights / weights.sum()


def _sparse(q: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., vocab] as (ids, probs) [..., support], its nonzero entries first, -1 / 0 padded."""
    order = torch.argsort((q > 0).float(), dim=-1, descending=True, stable=True)[..., :support]
    probs = q.gather(-1, order)
    return torch.where(probs > 0, order, -1), probs


def _sampled_trees(n: int, shape: list[int], p_table: dict, q_table: dict, generator, support: int = VOCAB):
    """n rows of one tree shape (children per node, by depth), each child drawn from its
    parent's q (i.i.d.); p_table / q_table give p and q after a path (a tuple of tokens)."""
    parents, paths = [-1], [()]
    frontier = [0]
    for children in shape:
        next_frontier = []
        for node in frontier:
            for _ in range(children):
                parents.append(node)
                paths.append(None)
                next_frontier.append(len(parents) - 1)
        frontier = next_frontier
    n_max = len(parents)
    d_max = len(shape)
    tokens = torch.zeros(n, n_max, dtype=torch.long)
    p = torch.zeros(n, n_max, VOCAB)
    q = torch.zeros(n, n_max, VOCAB)
    row_paths = [[()] + [None] * (n_max - 1) for _ in range(n)]
    for c in range(n_max):
        for b in range(n):
            if c:
                parent = parents[c]
                token = int(torch.multinomial(q[b, parent], 1, generator=generator))
                tokens[b, c] = token
                row_paths[b][c] = row_paths[b][parent] + (token,)
            p[b, c] = p_table(row_paths[b][c])
            q[b, c] = q_table(row_paths[b][c])
    q_ids, q_probs = _sparse(q, support)
    return (
        p,
        torch.tensor([parents] * n),
        tokens,
        torch.full((n,), n_max),
        q_ids.contiguous(),
        q_probs.contiguous(),
        torch.rand(n, n_max, generator=generator),
        torch.empty(n, d_max + 1, VOCAB).exponential_(generator=generator),
    )


def _tables(seed: int, zeros: int = 0):
    """p and q after each path: fixed per (path length, last token), q unlike p."""
    generator = torch.Generator().manual_seed(seed)
    p_rows = {key: _distribution(generator, VOCAB, zeros) for key in [(d, t) for d in range(4) for t in range(VOCAB)]}
    q_rows = {key: _distribution(generator, VOCAB, zeros) for key in p_rows}

    def key(path):
        return (len(path), path[-1] if path else 0)

    return (lambda path: p_rows[key(path)]), (lambda path: q_rows[key(path)])


def _wrong_rule(p, parents, tokens, num_nodes, q_ids, q_probs, uniforms, exponentials):
    """A plausible mistake: each sibling accepted with min(1, p / q) against the parent's own p
    (no residual after a rejection); the next token from p where none is kept."""
    batch = p.shape[0]
    rows = torch.arange(batch)
    current = torch.zeros(batch, dtype=torch.long)
    first = torch.full((batch,), -1)
    for c in range(1, p.shape[1]):
        tried = (parents[:, c] == current) & (first < 0)
        token = tokens[:, c]
        q_token = torch.where(q_ids[rows, current] == token[:, None], q_probs[rows, current], 0.0).sum(1)
        accepted = tried & (uniforms[:, c] * q_token < p[rows, current, token])
        first = torch.where(accepted, token, first)
    drawn = torch.argmax(p[:, 0] / exponentials[:, 0], dim=1)
    return torch.where(first >= 0, first, drawn)


def _chi_square(first_tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(first_tokens, minlength=VOCAB).double()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives no mass was emitted"
    expected = expected[keep].double() / expected[keep].double().sum()
    return stats.chisquare(counts[keep].numpy(), (expected * counts.sum()).numpy()).pvalue


@pytest.mark.parametrize("shape,zeros", [([3, 1], 0), ([2, 2], 1), ([4], 2)])
def test_sampled_tree_tokens_follow_the_target(shape, zeros):
    """The first token of a round follows the target's p, and the token after a kept draft p
    after it (chi-square over 6,000 rounds), with several siblings per node drawn from q
    unlike p."""
    p_table, q_table = _tables(seed=len(shape) * 10 + zeros, zeros=zeros)
    generator = torch.Generator().manual_seed(7)
    inputs = _sampled_trees(6000, shape, p_table, q_table, generator)
    output, num_accepted, path = tree_rejection_sample_reference(*inputs)
    assert _chi_square(output[:, 0], p_table(())) > 1e-3
    # The token after a kept first draft follows p after it: the kept node's subtree was drawn
    # independently of how the node was kept.
    for first in range(VOCAB):
        rows = (output[:, 0] == first) & (num_accepted >= 1)
        if rows.sum() > 400:
            assert _chi_square(output[rows, 1], p_table((first,))) > 1e-3, first
    assert (num_accepted > 0).float().mean() > 0.2, "the test should keep drafts as well as reject them"
    assert (path[:, 0] >= 0).sum() == (num_accepted > 0).sum()


def test_the_chi_square_catches_a_wrong_rule():
    p_table, q_table = _tables(seed=3)
    inputs = _sampled_trees(6000, [3, 1], p_table, q_table, torch.Generator().manual_seed(11))
    assert _chi_square(_wrong_rule(*inputs), p_table(())) < 1e-6


def test_greedy_tree_keeps_the_longest_path_of_argmaxes():
    vocab = 5
    # root -> (a=1, b=2); a -> (c=3); b -> (d=4, e=0); argmax after root 2, after b 0, after e 3.
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2]])
    tokens = torch.tensor([[0, 1, 2, 3, 4, 0]])
    logits = torch.zeros(1, 6, vocab)
    for node, best in {0: 2, 1: 3, 2: 0, 3: 1, 4: 1, 5: 3}.items():
        logits[0, node, best] = 1.0
    output, num_accepted, path = tree_greedy_verify_reference(logits, parents, tokens, torch.tensor([6]))
    assert num_accepted.tolist() == [2] and path.tolist() == [[2, 5]] and output.tolist() == [[2, 0, 3]]
    assert tree_depths(parents, torch.tensor([6])).tolist() == [[0, 1, 1, 2, 2, 2]]
    # A chain is a tree: the same result as the chain's rule.
    chain_output, chain_accepted, _ = tree_greedy_verify_reference(
        logits[:, [0, 2, 5]], torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 2, 0]]), torch.tensor([3])
    )
    assert chain_accepted.tolist() == [2] and chain_output.tolist() == [[2, 0, 3]]


def _random_trees(generator, batch: int, n_max: int, vocab: int, support: int, d_max: int):
    """Random rows (node counts, parents, tokens, distributions) for the kernel comparison:
    children drawn from their parent's q half the time, any token otherwise."""
    num_nodes = torch.randint(1, n_max + 1, (batch,), generator=generator)
    parents = torch.full((batch, n_max), -1)
    for c in range(1, n_max):
        parents[:, c] = torch.randint(0, c, (batch,), generator=generator)
    depths = tree_depths(parents, torch.full((batch,), n_max))
    parents = torch.where(depths <= d_max, parents, 0)  # keep every node within d_max
    p = torch.softmax(torch.randn(batch, n_max, vocab, generator=generator) * 3, -1)
    q = torch.softmax(torch.randn(batch, n_max, vocab, generator=generator) * 3, -1)
    top = q.topk(support, dim=-1)
    q_probs = top.values / top.values.sum(-1, keepdim=True)
    q_ids = top.indices
    if support > 2:
        q_ids[..., -1], q_probs[..., -1] = -1, 0.0  # padding
    parent_q = q_ids.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, support))
    pick = torch.randint(0, max(1, support - 1), (batch, n_max), generator=generator)
    tokens = torch.where(
        torch.rand(batch, n_max, generator=generator) < 0.5,
        parent_q.gather(2, pick[..., None])[..., 0],
        torch.randint(0, vocab, (batch, n_max), generator=generator),
    )
    p = torch.where(
        torch.rand(batch, n_max, 1, generator=generator) < 0.5,
        p,
        0.5 * p + 0.5 * (q * 0).scatter(2, q_ids.clamp(min=0), q_probs),
    )  # fmt: skip  (p close to q in half the nodes: acceptance)
    uniforms = torch.rand(batch, n_max, generator=generator)
    noise = torch.empty(batch, d_max + 1, vocab).exponential_(generator=generator)
    return [t.contiguous() for t in (p.float(), parents, tokens, num_nodes, q_ids, q_probs.float(), uniforms, noise)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton")
@pytest.mark.parametrize("batch,n_max,vocab,support", [(6, 9, 1500, 8), (3, 1, 257, 3), (4, 16, 2100, 33)])
def test_triton_equals_reference(batch, n_max, vocab, support):
    from specserve_kernels.tree_triton import tree_rejection_sample_triton

    generator = torch.Generator().manual_seed(batch * 100 + n_max)
    inputs = _random_trees(generator, batch, n_max, vocab, support, d_max=n_max - 1)
    expected = tree_rejection_sample_reference(*inputs)
    actual = tree_rejection_sample_triton(*(t.to(DEVICE) for t in inputs))
    for a, e in zip(actual, expected):
        assert torch.equal(a.cpu(), e)
    if n_max > 4:
        assert 0 < expected[1].sum(), "inputs should exercise acceptance"
