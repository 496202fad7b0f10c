"""A draft's one-token steps through torch.compile: the same logits as the eager forward,
for any rows and keys without compiling again, and the eager forward wherever they cannot run."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import specserve.model.compiled_steps as compiled_steps
from specserve.draft_jobs import DraftJob, DraftOptions
from specserve.drafting import Drafter
from specserve.model.backends.runner import RunnerBackend
from specserve.model.linear import cpu_has_bf16
from specserve.model.loading import LoadedModel
from specserve.model.runner import LlamaRunner
from specserve.sampling import SamplingParams, draft_noise, sparse_draws
from specserve.tools.testing import byte_tokenizer
from tests.test_runner import CONFIGS

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX") or "g++") is None, reason="torch.compile needs a C++ compiler on a CPU"
)


def save(name: str, directory):
    """CONFIGS[name] with random weights; a name ending in -float16 saves a float16 checkpoint,
    whose matrices are prepacked 16-bit ones (bfloat16) where the CPU multiplies them natively."""
    torch.manual_seed(len(name))
    model = AutoModelForCausalLM.from_config(CONFIGS[name.removesuffix("-float16")]()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaked distributions: greedy tokens are comparable
    (model.half() if name.endswith("-float16") else model).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def draft_runner(directory, compile_steps: bool) -> LlamaRunner:
    return LlamaRunner(str(directory), CPU, torch.float32, 4, 256, row_invariant=False, compile_steps=compile_steps)


# Biases and tied embeddings; GQA with a sliding window; Qwen3's q and k norms; Qwen2's qkv
# biases on prepacked matrices.
@needs_compiler
@pytest.mark.parametrize("name", ["llama-tied-bias", "mistral-sliding", "qwen3", "qwen2-float16"])
def test_compiled_steps_give_the_eager_logits_without_compiling_again(name, tmp_path, monkeypatch):
    torch._dynamo.reset()  # each runner's graphs count against torch's limit per function
    directory = save(name, tmp_path)
    runner, eager = draft_runner(directory, True), draft_runner(directory, False)
    runner.compiled_steps.thread.join(timeout=600)
    assert runner.compiled_steps.ready, "the warm-up failed: see the log"
    with torch._dynamo.config.patch(error_on_recompile=True):  # the warm-up compiled every graph needed
        check_against_eager(runner, eager, monkeypatch)

    monkeypatch.setattr(runner.compiled_steps, "step", None)  # a call would fail now
    slot = runner.allocate()
    assert runner.forward([slot], [0], [list(range(1, 18))], [2])[0].shape == (2, 300)  # 17 tokens: eager


def check_against_eager(runner: LlamaRunner, eager: LlamaRunner, monkeypatch) -> None:
    # Logits leave 16-bit (or int8) matrices in 16 bits: a few units in their last place apart.
    tolerance = 1e-4 if runner.matmul_dtype == torch.float32 and not runner.draft_matmul else 5e-2
    stepped = []
    step = runner.compiled_steps.step_with_argmax
    monkeypatch.setattr(runner.compiled_steps, "step_with_argmax", lambda *args: stepped.append(args[0]) or step(*args))

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (5, 70, 131)]
    slots = [[r.allocate() for _ in prompts] for r in (runner, eager)]
    for r, s in zip((runner, eager), slots):  # prefill: the eager forward, in both
        r.forward(s, [0, 0, 0], prompts, [1, 1, 1])
    starts = [len(p) for p in prompts]
    # One row; three rows; rows of two tokens and of one (a catch-up), crossing a key block,
    # with the logits of every token.
    for rows, tokens in (([0], [[7]]), ([0, 1, 2], [[1], [2], [3]]), ([2, 0, 1], [[4, 5], [6], [8, 9]])):
        num_logits = [len(t) for t in tokens]
        outs = [r.forward([s[b] for b in rows], [starts[b] for b in rows], tokens, num_logits)
                for r, s in zip((runner, eager), slots)]  # fmt: skip
        for compiled, expected, n in zip(*outs, num_logits):
            assert compiled.shape == expected.shape == (n, 300)
            torch.testing.assert_close(compiled, expected, atol=tolerance, rtol=tolerance)
        for b, t in zip(rows, tokens):
            starts[b] += len(t)
    # Greedy steps of all three rows: the same tokens.
    tokens = {id(r): [[0], [0], [0]] for r in (runner, eager)}
    for _ in range(12):
        hidden = {}
        for r, s in zip((runner, eager), slots):
            logits, argmax, hidden[id(r)] = r.forward_with_argmax(s, starts, tokens[id(r)], [1, 1, 1])
            tokens[id(r)] = [[int(row[-1].argmax())] for row in logits]
            # The compiled steps' own argmax (the greedy decision reads it): the logits' own.
            assert argmax == ([[t] for [t] in tokens[id(r)]] if r is runner else [None, None, None])
        assert tokens[id(runner)] == tokens[id(eager)]
        # The normed hidden states the logits came from (Medusa heads read them): the eager forward's.
        for compiled, expected in zip(hidden[id(runner)], hidden[id(eager)]):
            assert compiled.shape == expected.shape == (1, runner.spec.hidden_size)
            torch.testing.assert_close(compiled, expected, atol=tolerance, rtol=tolerance)
        starts = [n + 1 for n in starts]
    assert len(stepped) == 1 + 1 + 1 + 1 + 12  # every forward above: the prefill's 5-token row too


@needs_compiler  # supported() looks for one before anything is compiled
def test_a_step_that_disagrees_or_cannot_compile_leaves_the_eager_forward(tmp_path, monkeypatch, caplog):
    directory = save("llama-tied-bias", tmp_path)
    make_step = compiled_steps._make_step
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # no compiling: the check is what is tested
    off = lambda logits, hidden: (logits + 1e-2, hidden)  # noqa: E731
    monkeypatch.setattr(compiled_steps, "_make_step", lambda *a: lambda *b: off(*make_step(*a)(*b)))
    with caplog.at_level(logging.ERROR, logger="specserve.model.compiled_steps"):
        runner = draft_runner(directory, True)
        runner.compiled_steps.thread.join(timeout=60)
    assert runner.compiled_steps.failed and not runner.compiled_steps.ready
    assert "differs from the eager forward" in caplog.text
    slot = runner.allocate()
    assert runner.forward([slot], [0], [[1]], [1])[0].shape == (1, 300)

    monkeypatch.setenv("CXX", "no-such-compiler")
    with caplog.at_level(logging.INFO, logger="specserve.model.runner"):
        assert draft_runner(directory, True).compiled_steps is None
    assert "no-such-compiler is not on PATH" in caplog.text


def target_runner(directory, compile_steps: bool) -> LlamaRunner:
    """A verifier's runner: row-independent products, in bfloat16 (float32 ones are not compiled)."""
    return LlamaRunner(str(directory), CPU, torch.float32, 4, 256, torch.bfloat16, compile_steps=compile_steps)


@needs_compiler
@pytest.mark.skipif(not cpu_has_bf16(), reason="row-independent bfloat16 products need a CPU that has them")
@pytest.mark.parametrize("name", ["llama-tied-bias", "qwen3"])
def test_a_targets_compiled_steps_give_each_token_the_same_logits_in_any_batch(name, tmp_path):
    torch._dynamo.reset()
    directory = save(name, tmp_path)
    runner, eager = target_runner(directory, True), target_runner(directory, False)
    assert runner.compiled_steps.ready  # compiled before the constructor returned
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (40, 61, 150)]
    slots = {id(r): [r.allocate() for _ in prompts] for r in (runner, eager)}
    for r in (runner, eager):  # prefills of more than 16 tokens: eager in both
        r.forward(slots[id(r)], [0, 0, 0], prompts, [1, 1, 1])

    # Greedy decoding of row 0, one token a forward, beside rows that also decode.
    decoded, logits_alone, tokens = [], [], [[1], [2], [3]]
    starts = [len(p) for p in prompts]
    for _ in range(20):
        out = runner.forward(slots[id(runner)], starts, tokens, [1, 1, 1])
        expected = eager.forward(slots[id(eager)], starts, tokens, [1, 1, 1])
        for compiled, reference in zip(out, expected):
            torch.testing.assert_close(compiled, reference, atol=5e-2, rtol=5e-2)
        logits_alone.append(out[0][0])
        tokens = [[int(row[0].argmax())] for row in out]
        decoded.append(tokens[0][0])
        starts = [n + 1 for n in starts]

    # The same tokens fed again in verifies of K + 1 = 5 and 10 tokens (crossing a key block
    # at 64), beside a prefill (eager) and a decode: every token's logits to the bit, which
    # also takes the keys it wrote and read to be the bits written when it decoded.
    slot, other, third = slots[id(runner)]
    fed = [1, *decoded[:-1]]
    for k in (5, 10):
        for chunk in range(0, len(fed), k):
            out = runner.forward([other, slot, third], [0, len(prompts[0]) + chunk, 10],
                                 [prompts[1][:30], fed[chunk : chunk + k], [4]], [1, k, 1])  # fmt: skip
            for i, logits in enumerate(out[1]):
                assert torch.equal(logits, logits_alone[chunk + i]), (k, chunk + i)


@needs_compiler
def test_a_target_whose_steps_depend_on_the_batch_serves_eager(tmp_path, monkeypatch, caplog):
    directory = save("llama-tied-bias", tmp_path)
    make_step = compiled_steps._make_step
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # no compiling: the check is what is tested

    def batch_dependent(*args):
        step = make_step(*args)

        def rounded(*inputs):  # rows change the rounding
            logits, hidden = step(*inputs)
            return logits * (1 + 1e-7 * inputs[2].shape[0]), hidden

        return rounded

    monkeypatch.setattr(compiled_steps, "_make_step", batch_dependent)
    with caplog.at_level(logging.ERROR, logger="specserve.model.compiled_steps"):
        runner = target_runner(directory, True)
    assert runner.compiled_steps.failed and not runner.compiled_steps.ready
    assert "a target's results would depend on its batch" in caplog.text
    slot = runner.allocate()
    assert runner.forward([slot], [0], [[1]], [1])[0].shape == (1, 300)


@needs_compiler
def test_a_greedy_run_makes_the_tokens_of_as_many_steps_once_compiled(tmp_path, monkeypatch):
    """A draft's greedy runs: compiled once one is first asked for (None until then, the
    steps serve), then the tokens and keys of as many one-token steps in one call."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_steps, "RUN_STEPS", 3)  # counts 1 to 3: a shorter compile
    directory = save("llama-tied-bias", tmp_path)
    runner, eager = draft_runner(directory, True), draft_runner(directory, False)
    steps = runner.compiled_steps
    steps.thread.join(timeout=600)
    prompt = list(range(3, 40))
    slots = [r.allocate() for r in (runner, eager)]
    for r, s in zip((runner, eager), slots):
        r.forward([s], [0], [prompt], [1])
    assert steps.greedy_run(slots[0], len(prompt), 7, 3) is None and steps.compiling  # asked: compiling now
    steps.thread.join(timeout=600)
    assert not steps.compiling and sorted(steps._runs) == [("greedy", n) for n in (1, 2, 3)]
    assert steps.greedy_run(slots[0], len(prompt), 7, 4) is None and not steps.compiling  # past the longest
    made = steps.greedy_run(slots[0], len(prompt), 7, 3)
    expected, token = [], 7
    for i in range(3):
        token = int(eager.forward([slots[1]], [len(prompt) + i], [[token]], [1])[0][-1].argmax())
        expected.append(token)
    assert made == expected
    # The keys of the tokens fed (7 and the first two made) are in the slot: the next step agrees.
    after = [r.forward([s], [len(prompt) + 3], [[made[-1]]], [1])[0][-1] for r, s in zip((runner, eager), slots)]
    torch.testing.assert_close(after[0], after[1], atol=1e-4, rtol=1e-4)


@needs_compiler
def test_a_sampled_run_draws_as_the_steps_do_once_compiled(tmp_path, monkeypatch):
    """A draft's sampled runs: compiled once one is first asked for, then the draws of as
    many one-token steps (keyed noise, temperature and top_p) and their q in one call. A
    drafter's lone sampled session takes them, and proposes what its steps propose."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_steps, "RUN_STEPS", 3)
    directory = save("llama-tied-bias", tmp_path)
    runner, eager = draft_runner(directory, True), draft_runner(directory, False)
    steps = runner.compiled_steps
    steps.thread.join(timeout=600)
    prompt = list(range(3, 40))
    temperature, top_p = 4.0, 0.9  # the test model's distributions are peaked: flatter ones draw more tokens

    slots = [r.allocate() for r in (runner, eager)]
    for r, s in zip((runner, eager), slots):
        r.forward([s], [0], [prompt], [1])
    noise = draft_noise(seed=9, first_position=len(prompt) + 1, count=3, size=32, device=CPU)
    assert steps.sampled_run(slots[0], len(prompt), 7, temperature, top_p, noise) is None and steps.compiling
    steps.thread.join(timeout=600)
    assert sorted(steps._runs) == [("sampled", n) for n in (1, 2, 3)]
    made, ids, q = steps.sampled_run(slots[0], len(prompt), 7, temperature, top_p, noise)
    token = 7
    for i in range(3):
        logits = eager.forward([slots[1]], [len(prompt) + i], [[token]], [1])[0][-1:]
        expected = sparse_draws(logits, torch.tensor(temperature), torch.tensor(top_p), noise[i : i + 1])
        assert int(made[i]) == int(expected[0][0])
        torch.testing.assert_close(q[i], expected[2][0], atol=1e-4, rtol=1e-4)
        likely = q[i] > 1e-3
        assert torch.equal(ids[i][likely], expected[1][0][likely])
        token = int(made[i])
    assert int((q > 0).sum()) > 3  # some steps drew from several tokens

    loaded = LoadedModel(RunnerBackend(runner), None, "draft", 300, 256, (), "", CPU)
    drafter = Drafter({"draft_model": loaded}, DraftOptions(vocab_size=300, max_context_length=256, max_sessions=4))
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=3)

    runs, original = [], RunnerBackend.sampled_continue

    def counted(*args):
        made = original(*args)
        runs.append(made is not None)
        return made

    def propose(how: str):
        """Rounds of K = 3 after catch-ups of 20, 1, 3 and 1 tokens: the run's (its catch-up's
        last token its first step), none at hand, or one refused once asked for."""
        session = drafter.open_session("", "draft_model")
        with monkeypatch.context() as patch:  # without a run, the one-token steps draft
            if how == "none":
                patch.setattr(RunnerBackend, "has_run", lambda *args: False)
            patch.setattr(RunnerBackend, "sampled_continue", counted if how == "run" else lambda *args: None)
            ends = (0, 20, 21, 24, 25)
            jobs = [DraftJob(session, tuple(prompt[a:n]), n, 3, sampling) for a, n in zip(ends, ends[1:])]
            proposals = [drafter.step([job])[0] for job in jobs]
        drafter.close_session(session)
        return proposals

    proposed = propose("run")
    assert runs == [True] * 4
    for by_steps in (propose("none"), propose("refused")):
        for with_run, alike in zip(proposed, by_steps):
            assert with_run.draft_token_ids == alike.draft_token_ids and len(with_run.draft_token_ids) == 3
            assert len(with_run.draft_distributions) == 3
            for a, b in zip(with_run.draft_distributions, alike.draft_distributions):
                qa, qb = dict(zip(a.token_ids, a.probs)), dict(zip(b.token_ids, b.probs))
                shared = qa.keys() & qb.keys()  # near ties at the support's edge may round either way
                assert len(shared) >= len(qb) - 2 and abs(sum(a.probs) - 1) < 1e-5
                assert max(abs(qa[t] - qb[t]) for t in shared) < 1e-4
