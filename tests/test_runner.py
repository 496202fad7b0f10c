"""Our Llama-family runner against transformers: logits, greedy generations, batching."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import specserve.model.linear as linear_module
import specserve.model.weights as weights_module
from specserve.model.backends import RunnerBackend, TransformersBackend
from specserve.model.linear import Linear, cpu_has_bf16
from specserve.model.loading import load_model
from specserve.model.runner import LlamaRunner
from specserve.tools.testing import byte_tokenizer

CPU = torch.device("cpu")
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
CONFIGS = {
    "llama3": lambda: LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
    "llama-tied-bias": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=8),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_dir(request, tmp_path_factory):
    torch.manual_seed(len(request.param))
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaked distributions make greedy comparisons meaningful
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def reference_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # [len, vocab]


def test_logits_match_for_prefill_verify_decode_and_after_rollback(model_dir):
    runner = LlamaRunner(str(model_dir), CPU, torch.float32, num_slots=4, max_len=256)
    slots = [runner.allocate() for _ in range(3)]
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 300, (40,), generator=generator).tolist() for _ in range(3)]
    references = [reference_logits(model_dir, s) for s in sequences]

    cuts = [20, 7, 33]  # ragged prefill of three rows in one forward
    out = runner.forward(slots, [0, 0, 0], [s[:c] for s, c in zip(sequences, cuts)], cuts)
    for logits, reference, cut in zip(out, references, cuts):
        torch.testing.assert_close(logits, reference[:cut], atol=1e-4, rtol=0)

    # Verify-shaped (K + 1 = 5) and decode-shaped (1) rows together.
    out = runner.forward(slots, cuts, [sequences[0][20:25], sequences[1][7:8], sequences[2][33:38]], [5, 1, 5])
    torch.testing.assert_close(out[0], references[0][20:25], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], references[1][7:8], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], references[2][33:38], atol=1e-4, rtol=0)

    # Rollback: row 0 returns to 22 tokens and continues differently.
    other = sequences[0][:22] + torch.randint(0, 300, (6,), generator=generator).tolist()
    out = runner.forward([slots[0]], [22], [other[22:]], [6])
    torch.testing.assert_close(out[0], reference_logits(model_dir, other)[22:], atol=1e-4, rtol=0)


def greedy_with_runner(runner: LlamaRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy decoding of all prompts together, one batched decode step per token."""
    slots = [runner.allocate() for _ in prompts]
    logits = runner.forward(slots, [0] * len(prompts), prompts, [1] * len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        tokens = [int(row[-1].argmax()) for row in logits]
        for output, token in zip(outputs, tokens):
            output.append(token)
        positions = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs)]
        logits = runner.forward(slots, positions, [[t] for t in tokens], [1] * len(prompts))
    for slot in slots:
        runner.release(slot)
    return outputs


def test_greedy_generation_matches_transformers_and_batching_changes_nothing(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = LlamaRunner(str(model_dir), CPU, torch.float32, num_slots=4, max_len=256)
    prompts = [[5, 6, 7], [100, 3, 9, 200, 41, 17, 2], [250]]
    batched = greedy_with_runner(runner, prompts, steps=30)
    for prompt, tokens in zip(prompts, batched):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None)
        assert tokens == expected[0, len(prompt) :].tolist()
        assert greedy_with_runner(runner, [prompt], steps=30) == [tokens]  # alone == in a batch


def test_auto_backend_picks_the_runner_and_falls_back_to_transformers(model_dir, tmp_path, caplog):
    assert isinstance(load_model(str(model_dir), CPU, torch.float32).backend, RunnerBackend)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    byte_tokenizer().save_pretrained(tmp_path / "gpt2")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(tmp_path / "gpt2"), CPU, torch.float32)
    assert isinstance(loaded.backend, TransformersBackend)
    assert "falling back to transformers" in caplog.text
    assert loaded.max_context_length == 64


def test_slots_run_out_and_come_back(model_dir):
    runner = LlamaRunner(str(model_dir), CPU, torch.float32, num_slots=2, max_len=64)
    first, second = runner.allocate(), runner.allocate()
    assert runner.allocate() is None and runner.free_slots == 0
    runner.release(first)
    assert runner.allocate() == first and second is not None


def test_16_bit_checkpoint_matrices_stay_close(tmp_path):
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval()
    model.half().save_pretrained(tmp_path)  # weights exactly representable in float16
    auto = torch.bfloat16 if cpu_has_bf16() else torch.float32  # see auto_matmul_dtype
    assert LlamaRunner(str(tmp_path), CPU, torch.float32, 1, 256, row_invariant=False).matmul_dtype == auto
    runner = LlamaRunner(str(tmp_path), CPU, torch.float32, num_slots=1, max_len=256, matmul_dtype=torch.bfloat16)
    assert runner.layers[0].input_norm.dtype == torch.float32
    assert LlamaRunner(str(tmp_path), CPU, torch.float32, num_slots=1, max_len=256).matmul_dtype == auto
    exact = LlamaRunner(str(tmp_path), CPU, torch.float32, num_slots=1, max_len=256, matmul_dtype=torch.float32)
    tokens = list(range(3, 40))
    half = runner.forward([runner.allocate()], [0], [tokens], [len(tokens)])[0]
    full = exact.forward([exact.allocate()], [0], [tokens], [len(tokens)])[0]
    torch.testing.assert_close(full, reference_logits(tmp_path, tokens), atol=1e-4, rtol=0)
    assert (half - full).abs().max() < 3e-2 * full.abs().max()  # 16-bit matmul inputs and outputs
    assert torch.equal(half.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("matmul_dtype", [None, torch.float32])
def test_results_do_not_depend_on_k_or_on_the_batch(tmp_path, matmul_dtype):
    """With the matrices' dtype auto picks (row-independent kernels) or float32 (prepacked, a
    lone row sent twice) and query-by-query attention, a verify pass gives bitwise the logits
    of one-token steps, and a batched row those of the row alone: greedy speculative output
    cannot drift from target-only output."""
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval()
    model.half().save_pretrained(tmp_path)
    runner = LlamaRunner(str(tmp_path), CPU, torch.float32, num_slots=3, max_len=256, matmul_dtype=matmul_dtype)
    prompt, drafts = list(range(7, 40)), [5, 9, 11, 2, 8]
    one, two, three = runner.allocate(), runner.allocate(), runner.allocate()
    for slot in (one, two, three):
        runner.forward([slot], [0], [prompt], [1])
    verified = runner.forward([one], [len(prompt)], [drafts], [len(drafts)])[0]
    stepped = torch.cat([runner.forward([two], [len(prompt) + i], [[t]], [1])[0] for i, t in enumerate(drafts)])
    assert torch.equal(verified, stepped)
    batched = runner.forward([three, one], [len(prompt), len(prompt) + len(drafts)], [drafts, [3]], [len(drafts), 1])
    assert torch.equal(batched[0], verified)
    assert torch.equal(batched[1], runner.forward([two], [len(prompt) + len(drafts)], [[3]], [1])[0])


def test_prepacked_matrices_multiply_as_f_linear_does():
    """The oneDNN-prepacked 16-bit product changes speed only: bitwise F.linear's, any row count."""
    torch.manual_seed(5)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64)
        for b in (None, bias):
            expected = torch.nn.functional.linear(x.bfloat16(), weight, b).float()
            assert torch.equal(Linear(weight, b)(x), expected)


def test_float32_prepacked_products_do_not_depend_on_the_row_count():
    """oneDNN's float32 kernel for one row rounds unlike the one for two or more: Linear sends a
    lone row twice, so each row's product is the same in any batch (and F.linear's to 1e-5)."""
    torch.manual_seed(6)
    weight, bias = torch.randn(200, 96) / 10, torch.randn(200)
    for b in (None, bias):
        linear = Linear(weight, b)
        assert linear.packed is not None or not torch.backends.mkldnn.is_available()
        x = torch.randn(40, 96)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
        for rows in (2, 3, 5, 16, 17, 40):
            assert torch.equal(linear(x[:rows]), alone[:rows])
            assert torch.equal(linear(x[rows - 1 : 2 * rows - 1]), alone[rows - 1 : 2 * rows - 1])
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)


class _RowCountDependent:
    """A product that rounds differently with the number of rows, as some kernels do."""

    in_features, device = 8, CPU

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) + (1e-6 if len(x) > 4 else 0.0)


def test_the_row_independence_probe_catches_a_row_count_dependent_product():
    assert not linear_module.row_independent(_RowCountDependent())
    assert linear_module.row_independent(Linear(torch.randn(24, 8), row_invariant=True))


def test_an_auto_choice_that_depends_on_the_row_count_is_replaced_or_warned_of(tmp_path, monkeypatch, caplog):
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval().half().save_pretrained(tmp_path)
    auto = LlamaRunner(str(tmp_path), CPU, torch.float32, 1, 256).matmul_dtype
    probe = linear_module.row_independent
    monkeypatch.setattr(weights_module, "row_independent", lambda linear: linear.dtype != auto and probe(linear))
    replaced = LlamaRunner(str(tmp_path), CPU, torch.float32, 1, 256)
    assert replaced.matmul_dtype != auto and replaced.layers[0].qkv.dtype == replaced.matmul_dtype
    monkeypatch.setattr(weights_module, "row_independent", lambda linear: False)
    with caplog.at_level(logging.WARNING, logger="specserve.model.weights"):
        kept = LlamaRunner(str(tmp_path), CPU, torch.float32, 1, 256)
    assert kept.matmul_dtype == auto and kept.lm_head.dtype == auto and "depend on the row count" in caplog.text


def test_the_probe_tries_float16_only_for_a_float16_checkpoint(tmp_path, monkeypatch):
    torch.manual_seed(8)
    AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval().to(torch.bfloat16).save_pretrained(tmp_path)
    tried = []
    monkeypatch.setattr(weights_module, "row_independent", lambda linear: tried.append(linear.dtype) and False)
    runner = LlamaRunner(str(tmp_path), CPU, torch.float32, 1, 256)
    assert torch.float32 in tried and torch.float16 not in tried
    assert runner.matmul_dtype == tried[0] and runner.layers[1].down.dtype == tried[0]  # the first choice, kept
