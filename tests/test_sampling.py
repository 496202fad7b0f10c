"""Sampling math: the processed distribution matches transformers', the draft's sparse
distribution is exact, and randomness is keyed by (seed, position) alone."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specserve.errors import InvalidArgument
from specserve.sampling import (
    SamplingParams,
    draft_noise,
    mix_seed,
    processed_probs,
    sample_sparse,
    sparse_draws,
    truncate_to_support,
    verify_noise,
)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.9), (0.5, 20, 0.6)]
)
def test_processed_probs_match_transformers(temperature, top_k, top_p):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)) * 4
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    actual = processed_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.allclose(actual, expected, atol=1e-7)
    assert torch.equal(actual > 0, expected > 0)


def test_truncated_support_is_renormalised_top_k():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.3, 0.25])
    ids, q = truncate_to_support(probs, 3)
    assert ids.tolist() == [1, 3, 4]
    assert torch.allclose(q, torch.tensor([0.4, 0.3, 0.25]) / 0.95)
    ids, q = truncate_to_support(probs, 10)  # zero-mass tokens never enter the support
    assert 2 not in ids.tolist() and abs(q.sum().item() - 1) < 1e-6


def test_sparse_draws_follow_q():
    ids, q = torch.tensor([7, 3, 9]), torch.tensor([0.6, 0.3, 0.1])
    draws = torch.tensor([sample_sparse(ids, q, seed=seed, position=5) for seed in range(6000)])
    frequencies = torch.stack([(draws == t).float().mean() for t in (7, 3, 9)])
    assert torch.allclose(frequencies, q, atol=0.025)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 1.0), (0.7, 0.9), (1.5, 0.3)])
def test_sparse_draws_in_a_graph_are_the_steps_draws(temperature, top_p):
    """A compiled run's draws (sparse_draws: support, nucleus and draw in tensor ops) give the
    support, q and token that processed_probs, truncate_to_support and sample_sparse give,
    with the same keyed noise; a peaked row keeps fewer than the support's width."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)) * 3
    logits[0, 17] = 300  # all the mass on one token: the rest of the support has none
    noise = draft_noise(seed=5, first_position=30, count=8, size=32, device=torch.device("cpu"))
    top_p_given = torch.tensor(top_p if top_p < 1 else float("inf"))
    tokens, ids, q = sparse_draws(logits, torch.tensor(temperature), top_p_given, noise)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=5)
    for row in range(8):
        expected_ids, expected_q = truncate_to_support(processed_probs(logits[row : row + 1], params)[0], 32)
        kept = q[row] > 0
        assert ids[row][kept].tolist() == expected_ids.tolist()
        torch.testing.assert_close(q[row][kept], expected_q, atol=1e-6, rtol=1e-5)
        assert int(tokens[row]) == sample_sparse(expected_ids, expected_q, seed=5, position=30 + row)
    assert int(tokens[0]) == 17 and int((q[0] > 0).sum()) == 1


def test_keyed_randomness_depends_on_seed_and_position_only():
    a = verify_noise(seed=11, first_position=40, num_draft=3, k_max=3, vocab=50, device=torch.device("cpu"))
    b = verify_noise(seed=11, first_position=40, num_draft=3, k_max=6, vocab=50, device=torch.device("cpu"))
    assert torch.equal(a[0], b[0][:3]) and torch.equal(a[1], b[1][:4])
    # Position 42 draws the same numbers whether it is reached as draft 3 or as draft 1.
    c = verify_noise(seed=11, first_position=42, num_draft=1, k_max=1, vocab=50, device=torch.device("cpu"))
    assert torch.equal(a[0][2], c[0][0]) and torch.equal(a[1][2], c[1][0])
    other = verify_noise(seed=12, first_position=40, num_draft=3, k_max=3, vocab=50, device=torch.device("cpu"))
    assert not torch.equal(a[1], other[1])
    assert len({mix_seed(1, position, 0) for position in range(1000)}) == 1000


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"seed": -1}],
)
def test_bad_sampling_params_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)
