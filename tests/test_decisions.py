"""The verifier's sampled decision on the CPU (verify_service/decisions.py): the same tokens as
the reference kernel given the same randomness, and top-p's nucleus found by partial selection
equal to the one a full sort finds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.protocol import SparseDistribution
from specserve.sampling import SamplingParams, nucleus, processed_probs, truncate_to_support, verify_noise
from specserve_kernels.rejection_reference import rejection_sample_reference
from verify_service.decisions import decide_sampled_row

VOCAB = 300


def _row(generator: torch.Generator, k: int, sampling: SamplingParams, spread: float) -> SimpleNamespace:
    """A verify row whose drafts were drawn from a draft q near the target's p (so that some
    are kept and some rejected), with q's support cut to 8 tokens as a draft's is."""
    logits = torch.randn(k + 1, VOCAB, generator=generator) * spread
    p = processed_probs(logits, sampling)
    drafts, distributions = [], []
    for i in range(k):
        q = (p[i] + 0.3 * torch.rand(VOCAB, generator=generator) * p[i].max()).clamp_min(0)
        ids, probs = truncate_to_support(q / q.sum(), 8)
        drafts.append(int(ids[torch.multinomial(probs, 1, generator=generator)]))
        distributions.append(SparseDistribution(tuple(ids.tolist()), tuple(probs.tolist())))
    return SimpleNamespace(
        logits=logits, sampling=sampling, drafts=tuple(drafts), distributions=tuple(distributions),
        first_position=int(torch.randint(0, 500, (1,), generator=generator)),
    )  # fmt: skip


def _reference(row: SimpleNamespace) -> tuple[int, int]:
    """The reference kernel over the row, with every position's noise drawn."""
    k = len(row.drafts)
    probs = processed_probs(row.logits, row.sampling)[None]
    q_ids = torch.full((1, k, 8), -1, dtype=torch.long)
    q_probs = torch.zeros(1, k, 8)
    for i, d in enumerate(row.distributions):
        q_ids[0, i, : len(d.token_ids)] = torch.tensor(d.token_ids)
        q_probs[0, i, : len(d.probs)] = torch.tensor(d.probs)
    uniforms, noise = verify_noise(row.sampling.seed, row.first_position, k, k, VOCAB, torch.device("cpu"))
    drafts = torch.tensor([row.drafts], dtype=torch.long).reshape(1, k)
    output, accepted = rejection_sample_reference(
        probs, drafts, torch.tensor([k]), q_ids, q_probs, uniforms[None], noise[None]
    )
    n = int(accepted[0])
    return n, int(output[0, n])


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.01, seed=8),
    ],
)
def test_row_decision_equals_the_reference_kernel(sampling):
    generator = torch.Generator().manual_seed(0)
    outcomes = set()
    for trial in range(150):
        row = _row(generator, k=trial % 5, sampling=sampling, spread=1.0 + trial % 4)
        decision = decide_sampled_row(row)
        assert decision == _reference(row), trial
        outcomes.add(decision[0] < len(row.drafts))
    assert outcomes == {True, False}  # both rejections (residual draws) and bonus draws were decided


def test_row_decision_follows_the_target_distribution():
    """One draft, its q far from p: the first token made follows p (chi-square over seeds)."""
    from scipy import stats

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (VOCAB - 5)] * 2)
    p = processed_probs(logits, SamplingParams(temperature=1.0))[0, :5]
    q = SparseDistribution((3, 4, 0), (0.6, 0.3, 0.1))
    counts = torch.zeros(5)
    for seed in range(3000):
        draft = q.token_ids[
            int(torch.multinomial(torch.tensor(q.probs), 1, generator=torch.Generator().manual_seed(seed)))
        ]
        row = SimpleNamespace(logits=logits, sampling=SamplingParams(temperature=1.0, seed=seed), drafts=(draft,),
                              distributions=(q,), first_position=7)  # fmt: skip
        kept, token = decide_sampled_row(row)
        counts[draft if kept else token] += 1
    assert stats.chisquare(counts.numpy(), (p / p.sum() * counts.sum()).numpy()).pvalue > 1e-3


def test_nucleus_by_partial_selection_equals_a_sort():
    generator = torch.Generator().manual_seed(1)
    for spread in (0.5, 2.0, 8.0):  # flat: the selection widens to the whole vocabulary
        probs = (torch.randn(6, 5000, generator=generator) * spread).softmax(-1)
        for top_p in (1e-6, 0.5, 0.9, 0.999):
            ordered, order = torch.sort(probs, dim=-1, descending=True)
            keep_sorted = (ordered.cumsum(-1) - ordered) < top_p
            keep_sorted[:, 0] = True
            expected = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
            assert torch.equal(nucleus(probs, top_p), expected), (spread, top_p)
