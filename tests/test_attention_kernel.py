"""Exact attention: the Triton kernel against its reference, its outputs independent of the
launch, and the runner's verify and decode passes on it."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

import specserve_kernels.attention as attention_kernels
import specserve_kernels.attention_triton as attention_triton
from specserve.model.runner import LlamaRunner
from specserve_kernels.attention_reference import exact_attention_reference
from specserve_kernels.attention_triton import exact_attention_triton

# The Triton kernel runs on CUDA where there is one, else on the CPU under TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton"
)
CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _inputs(generator, tokens, heads, kv_heads, head_dim, max_len, slots, dtype):
    k_cache = torch.randn(slots, kv_heads, max_len, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(slots, kv_heads, max_len, head_dim, generator=generator).to(dtype)
    # q a split view, as the runner's is: rows of (heads + kv_heads) heads, the first `heads` taken.
    q = torch.randn(tokens, heads + kv_heads, head_dim, generator=generator).to(dtype)[:, :heads]
    token_slots = torch.randint(0, slots, (tokens,), generator=generator)
    token_positions = torch.randint(0, max_len, (tokens,), generator=generator)
    token_positions[0] = max_len - 1  # the longest: several key blocks
    token_positions[-1] = 0  # one key
    return q, k_cache, v_cache, token_slots, token_positions


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window",
    [(4, 2, 16, None), (4, 4, 32, 7), (6, 2, 24, None), (2, 1, 64, 100)],
)
@pytest.mark.parametrize("split_keys", [64, 256])  # 150 keys: three splits, or one
def test_triton_equals_reference(heads, kv_heads, head_dim, window, dtype, split_keys):
    generator = torch.Generator().manual_seed(heads * 100 + head_dim)
    q, k_cache, v_cache, slots, positions = _inputs(generator, 9, heads, kv_heads, head_dim, 150, 3, dtype)
    scale = head_dim**-0.5
    expected = exact_attention_reference(q.float(), k_cache.float(), v_cache.float(), slots, positions, window, scale)
    args = (q, k_cache, v_cache, slots, positions)
    actual = exact_attention_triton(*(t.to(DEVICE) for t in args), window, scale, split_keys=split_keys)
    assert actual.dtype == dtype and actual.shape == (9, heads, head_dim)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().float(), expected, atol=tolerance, rtol=tolerance)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_the_other_tokens_of_the_launch(dtype):
    generator = torch.Generator().manual_seed(3)
    inputs = [t.to(DEVICE) for t in _inputs(generator, 12, 4, 2, 32, 130, 4, dtype)]
    q, k_cache, v_cache, slots, positions = inputs
    # 130 keys in splits of 64: tokens of one to three splits; alone, a launch has as many
    # splits as its token needs, together as many as the longest.
    together = exact_attention_triton(q, k_cache, v_cache, slots, positions, None, 0.2, split_keys=64)
    for t in range(len(q)):
        one = slice(t, t + 1)
        alone = exact_attention_triton(q[one], k_cache, v_cache, slots[one], positions[one], None, 0.2, split_keys=64)
        assert torch.equal(alone[0], together[t])
    order = torch.randperm(len(q), generator=generator).to(DEVICE)
    shuffled = exact_attention_triton(
        q[order], k_cache, v_cache, slots[order], positions[order], None, 0.2, max_keys=500, split_keys=64
    )
    assert torch.equal(shuffled, together[order])


@needs_triton
@pytest.mark.parametrize("config", [LlamaConfig, lambda **kw: MistralConfig(**kw, sliding_window=6)])
def test_the_runner_on_the_triton_kernel_verifies_as_it_decodes(tmp_path, monkeypatch, config):
    """The runner with its exact attention on the kernel (on a CPU: interpreted) against the
    runner on the reference: close logits, and on a CPU verify logits bitwise those of
    one-token steps and of the row in a batch. (On CUDA the bitwise part would test cuBLAS's
    row-count dependence, not the kernel's.)"""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    shape = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    AutoModelForCausalLM.from_config(config(**shape)).eval().save_pretrained(tmp_path)
    prompt, drafts = list(range(3, 23)), [5, 9, 11, 2, 8]

    def run(attention) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(attention_kernels, "exact_attention", attention)
        runner = LlamaRunner(str(tmp_path), torch.device(DEVICE), torch.float32, num_slots=3, max_len=128)
        one, two, three = runner.allocate(), runner.allocate(), runner.allocate()
        for slot in (one, two, three):
            runner.forward([slot], [0], [prompt], [1])
        verified = runner.forward([one], [len(prompt)], [drafts], [len(drafts)])[0]
        stepped = torch.cat([runner.forward([two], [len(prompt) + i], [[t]], [1])[0] for i, t in enumerate(drafts)])
        batched = runner.forward([three, one], [len(prompt), len(prompt) + 5], [drafts, [3]], [5, 1])
        return verified, stepped, batched

    reference = run(exact_attention_reference)
    calls = []

    def counted(q, *args):
        calls.append(len(q))
        return exact_attention_triton(q, *args)

    verified, stepped, batched = run(counted)
    assert calls == [5] * 2 + [1] * 10 + [6] * 2  # verify, 5 steps, the batch; 2 layers each (prefills masked)
    if DEVICE == "cpu":
        assert torch.equal(verified, stepped) and torch.equal(batched[0], verified)
    torch.testing.assert_close(verified, reference[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepped, reference[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], reference[2][1], atol=1e-5, rtol=1e-5)


PROBE = (torch.device(DEVICE), torch.float32, 6, 2, 24, 9)  # device, dtype, heads, kv heads, head dim, window


@needs_triton
def test_the_load_time_check_passes_the_kernel_and_fails_a_broken_one(monkeypatch):
    assert attention_kernels.triton_kernel_works(*PROBE)
    monkeypatch.setattr(attention_triton, "exact_attention_triton", lambda *args: exact_attention_triton(*args) * 1.01)
    assert not attention_kernels.triton_kernel_works(*PROBE)

    def fails(*args):
        raise RuntimeError("PTX compilation failed")

    monkeypatch.setattr(attention_triton, "exact_attention_triton", fails)
    assert not attention_kernels.triton_kernel_works(*PROBE)
