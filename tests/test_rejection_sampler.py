"""The rejection rule: analytically, statistically, greedy, and Triton == reference."""

from __future__ import annotations

import os

import pytest
import torch
from scipy import stats

from specserve_kernels.rejection_reference import greedy_verify_reference, rejection_sample_reference

VOCAB = 12
# The Triton kernels run on CUDA where there is one, else on the CPU under TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_pair(
    generator: torch.Generator, zero_q_where_p: bool, zero_p_where_q: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q over VOCAB tokens; optionally q has no mass on some of p's support and the reverse."""
    p = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample() if generator is None else _dirichlet(generator)
    q = _dirichlet(generator)
    if zero_q_where_p:
        q[:3] = 0  # p > 0 there: only the recovered token can produce these
    if zero_p_where_q:
        p[-3:] = 0  # q > 0 there: drafts of these must always be rejected
    return p / p.sum(), q / q.sum()


def _dirichlet(generator: torch.Generator) -> torch.Tensor:
    gamma = -torch.log(torch.rand(VOCAB, generator=generator, dtype=torch.float64))
    return (gamma / gamma.sum()).float()


def rule_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact output distribution of the rule: accept x ~ q w.p. min(1, p/q), else draw from
    norm(max(0, p - q))."""
    p, q = p.double(), q.double()
    accept = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp_min(1e-300)), torch.zeros_like(p))
    residual = (p - q).clamp_min(0)
    rejected_mass = 1 - (q * accept).sum()
    recovered = residual / residual.sum() if residual.sum() > 0 else p
    return q * accept + rejected_mass * recovered


def sparse(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense q [..., vocab] -> padded sparse (ids, probs) [..., vocab] as the wire carries it."""
    ids = torch.where(q > 0, torch.arange(q.shape[-1]).expand_as(q), -1)
    return ids.long(), torch.where(q > 0, q, 0.0)


def run_reference(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator):
    """p [batch, k + 1, vocab], q [batch, k, vocab], drafts [batch, k] -> reference outputs."""
    batch, k = drafts.shape
    q_ids, q_probs = sparse(q)
    uniforms = torch.rand(batch, k, generator=generator)
    noise = torch.empty(batch, k + 1, p.shape[-1]).exponential_(generator=generator)
    num_draft = torch.full((batch,), k, dtype=torch.long)
    return rejection_sample_reference(p, drafts, num_draft, q_ids, q_probs, uniforms, noise)


@pytest.mark.parametrize("zero_q_where_p,zero_p_where_q", [(False, False), (True, False), (False, True), (True, True)])
def test_rule_is_lossless_analytically(zero_q_where_p, zero_p_where_q):
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        p, q = random_pair(generator, zero_q_where_p, zero_p_where_q)
        assert torch.allclose(rule_distribution(p, q), p.double(), atol=1e-6)


def test_accept_threshold_is_min_one_p_over_q():
    """The implementation accepts d exactly when u < p(d) / q(d), on a fine grid of u."""
    generator = torch.Generator().manual_seed(2)
    p, q = random_pair(generator, True, True)
    grid = (torch.arange(4000) + 0.5) / 4000
    for token in torch.nonzero(q > 0).flatten().tolist():
        batch = grid.shape[0]
        q_ids, q_probs = sparse(q.expand(batch, 1, VOCAB).contiguous())
        _, accepted = rejection_sample_reference(
            p.expand(batch, 2, VOCAB).contiguous(), torch.full((batch, 1), token), torch.ones(batch, dtype=torch.long),
            q_ids, q_probs, grid[:, None].contiguous(), torch.ones(batch, 2, VOCAB),
        )  # fmt: skip
        expected = min(1.0, (p[token] / q[token]).item())
        assert abs(accepted.float().mean().item() - expected) <= 1 / 4000 + 1e-6


def _chi_square_pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = p.double() / p.double().sum() * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:
        return 0.0  # a token the target gives no probability: certainly not p
    return stats.chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


@pytest.mark.parametrize("zero_q_where_p,zero_p_where_q", [(False, False), (True, True)])
def test_sampled_tokens_follow_target(zero_q_where_p, zero_p_where_q):
    """200k verifications, K = 2: the token at each position follows p, not q."""
    generator = torch.Generator().manual_seed(3)
    batch, k = 200_000, 2
    pairs = [random_pair(generator, zero_q_where_p, zero_p_where_q) for _ in range(k + 1)]
    p = torch.stack([pair[0] for pair in pairs]).expand(batch, k + 1, VOCAB).contiguous()
    q = torch.stack([pair[1] for pair in pairs[:k]]).expand(batch, k, VOCAB).contiguous()
    drafts = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=generator).reshape(batch, k)
    output, num_accepted = run_reference(p, q, drafts, generator)
    assert _chi_square_pvalue(output[:, 0], p[0, 0]) > 1e-3
    reached_second = num_accepted >= 1
    assert _chi_square_pvalue(output[reached_second, 1], p[0, 1]) > 1e-3
    # The same test rejects the draft's own distribution: it has the power to fail.
    assert _chi_square_pvalue(drafts[:, 0], p[0, 0]) < 1e-6
    # All accepted: the bonus token follows p_{K+1}.
    assert _chi_square_pvalue(output[num_accepted == k, k], p[0, k]) > 1e-3


def test_greedy_rule():
    logits = torch.tensor(
        [
            [[0, 5, 1], [4, 0, 0], [0, 0, 9], [1, 1, 0]],  # argmax 1, 0, 2, 0 (a tie picks the first)
            [[0, 5, 1], [4, 0, 0], [0, 0, 9], [1, 1, 0]],
            [[0, 5, 1], [4, 0, 0], [0, 0, 9], [1, 1, 0]],
        ],
        dtype=torch.float32,
    )
    drafts = torch.tensor([[1, 0, 2], [1, 2, 2], [2, 0, 0]])
    num_draft = torch.tensor([3, 3, 0])
    output, num_accepted = greedy_verify_reference(logits, drafts, num_draft)
    assert num_accepted.tolist() == [3, 1, 0]
    assert output.tolist() == [[1, 0, 2, 0], [1, 0, -1, -1], [1, -1, -1, -1]]


def _kernel_inputs(generator: torch.Generator, batch: int, k_max: int, vocab: int, support: int):
    logits = torch.randn(batch, k_max + 1, vocab, generator=generator) * 3
    p = logits.softmax(-1)
    # q: the target's distribution blurred and truncated to a top-`support` support, so that
    # drafts are accepted as well as rejected.
    blurred = (logits + torch.randn(batch, k_max + 1, vocab, generator=generator))[:, :k_max].softmax(-1)
    top = blurred.topk(support, dim=-1)
    q_ids, q_probs = top.indices.contiguous(), (top.values / top.values.sum(-1, keepdim=True)).contiguous()
    pick = torch.multinomial(q_probs.reshape(-1, support), 1, generator=generator).reshape(batch, k_max)
    drafts = q_ids.gather(2, pick[..., None])[..., 0].contiguous()
    num_draft = torch.randint(0, k_max + 1, (batch,), generator=generator)
    short = torch.arange(k_max)[None, :] >= num_draft[:, None]  # padding past each row's K
    q_ids[short] = -1
    q_probs[short] = 0.0
    uniforms = torch.rand(batch, k_max, generator=generator)
    noise = torch.empty(batch, k_max + 1, vocab).exponential_(generator=generator)
    return logits, p, drafts, num_draft, q_ids, q_probs, uniforms, noise


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton")
@pytest.mark.parametrize(
    "batch,k_max,vocab,support", [(7, 4, 1500, 16), (3, 1, 257, 5), (5, 8, 2100, 33), (4, 0, 300, 1)]
)
def test_triton_equals_reference(batch, k_max, vocab, support):
    from specserve_kernels.rejection_triton import greedy_verify_triton, rejection_sample_triton

    generator = torch.Generator().manual_seed(batch * 100 + k_max)
    logits, p, drafts, num_draft, q_ids, q_probs, uniforms, noise = _kernel_inputs(
        generator, batch, k_max, vocab, support
    )
    expected = rejection_sample_reference(p, drafts, num_draft, q_ids, q_probs, uniforms, noise)
    actual = rejection_sample_triton(*(t.to(DEVICE) for t in (p, drafts, num_draft, q_ids, q_probs, uniforms, noise)))
    assert torch.equal(actual[0].cpu(), expected[0]) and torch.equal(actual[1].cpu(), expected[1])
    if k_max > 0:
        assert 0 < expected[1].sum() < num_draft.sum(), "inputs should exercise acceptance and rejection"

    greedy_drafts = torch.where(
        torch.rand(batch, k_max, generator=generator) < 0.7, logits[:, :k_max].argmax(-1), drafts
    )
    expected = greedy_verify_reference(logits, greedy_drafts.contiguous(), num_draft)
    actual = greedy_verify_triton(*(t.to(DEVICE) for t in (logits, greedy_drafts.contiguous(), num_draft)))
    assert torch.equal(actual[0].cpu(), expected[0]) and torch.equal(actual[1].cpu(), expected[1])
