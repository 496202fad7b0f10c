"""End to end through real processes: `specserve up` on loopback ports, real HTTP clients."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from scipy import stats
from transformers import AutoModelForCausalLM

from specserve.model.linear import cpu_has_bf16
from tests.conftest import free_port, metric, start_stack, stop_process, up_command
from tests.test_compiled_steps import needs_compiler

PROMPTS = [
    (72, 101, 108, 108, 111),
    (100, 101, 102, 32, 102, 40),
    (10, 32, 32, 32, 32),
    (1, 2, 3, 4, 5, 6, 7, 8),
    (200,),
]


def complete(url: str, **body) -> dict:
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def token_ids(url: str, prompt, **body) -> list[int]:
    return complete(url, prompt=list(prompt), return_token_ids=True, **body)["choices"][0]["token_ids"]


def target_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=256
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_greedy_speculative_equals_target_only_and_transformers(request, stack_name):
    """For the verifier's own rounds and for a draft service's."""
    stack = request.getfixturevalue(stack_name)

    def run(args):
        prompt, method, k = args
        return token_ids(stack.url, prompt, max_tokens=40, temperature=0,
                         speculation={"method": method, "num_speculative_tokens": k})  # fmt: skip

    methods = (("draft_model", 4), ("draft_model", 2), ("early_exit", 3), ("ngram", 4), ("none", 1))
    jobs = [(prompt, method, k) for prompt in PROMPTS for method, k in methods]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all at once: sessions share batches
        results = dict(zip(jobs, pool.map(run, jobs)))
    model = AutoModelForCausalLM.from_pretrained(stack.target_dir).eval()
    for prompt in PROMPTS:
        reference = results[(prompt, "none", 1)]
        assert len(reference) == 40 or reference[-1] == 256
        for method, k in methods:
            assert results[(prompt, method, k)] == reference, (method, k)
        assert reference == target_greedy(model, prompt, 40)


def test_a_cpu_stack_speculates_while_one_request_runs_and_stays_exact_beyond(split_stack):
    """`specserve up --draft-service` on the CPU passes the gateway --max-speculating-requests 1
    (the verifier that drafts for itself weighs its batch instead: tests/test_speculation.py)."""
    stack = split_stack

    def run(prompt, **body):  # a fixed K: whether a round drafts is the load's doing alone
        body = {"temperature": 0, "speculation": {"adaptive": False}, **body}
        return complete(stack.url, prompt=list(prompt), max_tokens=60, return_token_ids=True, **body)

    references = [run(p, speculation={"method": "none"})["choices"][0]["token_ids"] for p in PROMPTS]
    alone = [run(p) for p in PROMPTS]  # one at a time: every round speculates
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(run, PROMPTS))
        seeded = list(pool.map(lambda p: run(p, temperature=0.8, seed=7), PROMPTS))
    assert [r["choices"][0]["token_ids"] for r in alone] == references
    assert [r["choices"][0]["token_ids"] for r in together] == references
    drafted = [sum(r["usage"]["speculation"]["num_drafts"] for r in replies) for replies in (alone, together, seeded)]
    # Crowded, greedy requests decode target-only; seeded sampled ones keep speculating.
    assert drafted[0] > 0 and drafted[1] < drafted[0] and all(r["usage"]["speculation"]["num_drafts"] for r in seeded)


@needs_compiler
@pytest.mark.skipif(not cpu_has_bf16(), reason="a target's compiled steps take bfloat16 matrices, native here")
def test_compiled_steps_keep_greedy_output_and_the_stack_is_ready_once_they_are_built(tiny_pair, tmp_path):
    """The target compiles before it serves (bfloat16 matrices: float32 ones are not compiled);
    the verifier reports ready once its drafts' steps are built too, so that no early request
    drafts at the eager forward's speed."""
    log, verify_metrics = tmp_path / "stack.log", free_port()
    env = {"SPECSERVE_VERIFY_COMPILE_STEPS": "1", "SPECSERVE_VERIFY_MATMUL_DTYPE": "bfloat16",
           "SPECSERVE_LOG_LEVEL": "INFO"}  # fmt: skip
    compiled = start_stack(*tiny_pair, env=env, metrics_ports=(free_port(), verify_metrics), log_path=log,
                           healthy_timeout_s=600)  # fmt: skip
    try:
        text = log.read_text()
        assert metric(verify_metrics, "specserve:drafter_compiling_steps") == 0
        assert text.count("compiled the draft's one-token steps") == 2  # both drafts, before ready
        assert text.count("compiled the target's one-token steps") == 1

        def run(job):
            prompt, method = job
            return token_ids(compiled.url, prompt, max_tokens=40, temperature=0,
                             speculation={"method": method, "num_speculative_tokens": 4})  # fmt: skip

        jobs = [(prompt, method) for prompt in PROMPTS for method in ("none", "draft_model", "early_exit")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = dict(zip(jobs, pool.map(run, jobs)))
        alone = {job: run(job) for job in jobs}  # a lone greedy session drafts through greedy runs once built
        for prompt in PROMPTS:
            reference = together[(prompt, "none")]
            for results in (together, alone):
                assert [results[(prompt, m)] for m in ("none", "draft_model", "early_exit")] == [reference] * 3
    finally:
        stop_process(compiled.process)


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_adaptive_k_and_confidence_stop_keep_greedy_output(request, stack_name):
    stack = request.getfixturevalue(stack_name)
    reference = token_ids(stack.url, PROMPTS[1], max_tokens=40, temperature=0, speculation={"method": "none"})
    for speculation in ({"adaptive": True, "num_speculative_tokens": 2}, {"min_draft_probability": 0.6},
                        {"adaptive": False}, {"pipeline": True, "adaptive": False},
                        {"pipeline": True, "adaptive": True, "method": "early_exit"},
                        {"adaptive": True, "min_draft_probability": 0.3, "method": "ngram"},
                        {"adaptive": False, "min_draft_probability": 0.3, "method": "ngram"}):  # fmt: skip
        body = complete(stack.url, prompt=list(PROMPTS[1]), max_tokens=40, temperature=0, return_token_ids=True,
                        return_timings=True, speculation=speculation)  # fmt: skip
        assert body["choices"][0]["token_ids"] == reference, speculation
        if speculation.get("pipeline") and "method" not in speculation and stack.draft_address:
            assert body["usage"]["timings"]["pipelined_rounds"] >= 1  # some guesses held (a draft service's rounds)
    # ngram found repeats to copy in this looping output (fixed K: an adaptive session may
    # rightly draft nothing in 40 tokens where the process's costs say copies do not pay).
    assert body["usage"]["speculation"]["num_drafts"] >= 1


def test_speculation_usage_is_reported_and_drafts_are_accepted(stack):
    body = complete(stack.url, prompt=list(PROMPTS[1]), max_tokens=48, temperature=0,
                    speculation={"num_speculative_tokens": 4, "adaptive": False})  # fmt: skip
    usage = body["usage"]
    speculation = usage["speculation"]
    assert usage["completion_tokens"] == 48 and usage["prompt_tokens"] == len(PROMPTS[1])
    assert speculation["num_drafts"] >= 1
    assert 0 < speculation["num_accepted_tokens"] < speculation["num_draft_tokens"]
    # Every round emits accepted drafts + 1 token; the first token comes from the prefill.
    rounds_tokens = usage["completion_tokens"] - 1
    assert rounds_tokens >= speculation["num_accepted_tokens"] + speculation["num_drafts"] - 1
    mean_accepted_length = (speculation["num_accepted_tokens"] + speculation["num_drafts"]) / speculation["num_drafts"]
    assert mean_accepted_length >= 1.3  # a floor: the half-agreeing draft must be kept often


def _target_first_two_token_distributions(target_dir, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact p(t1 | prompt) and the marginal p(t2) = sum_t1 p(t1) p(t2 | prompt, t1)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)  # [vocab]
        vocab = first.shape[0]
        extended = torch.cat([torch.tensor(prompt).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = model(extended).logits[:, -1].double().softmax(-1)  # [vocab (t1), vocab (t2)]
    return first, first @ second


def _chi_square(observed: list[int], expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(observed), minlength=expected_probs.shape[0]).double()
    expected = expected_probs * counts.sum()
    order = torch.argsort(expected, descending=True)
    big = order[expected[order] >= 5]  # pool the rare tokens into one bin
    rest = order[expected[order] < 5]
    observed_bins = torch.cat([counts[big], counts[rest].sum()[None]])
    expected_bins = torch.cat([expected[big], expected[rest].sum()[None]])
    return stats.chisquare(observed_bins.numpy(), expected_bins.numpy()).pvalue


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_sampled_tokens_follow_the_target_distribution(request, stack_name):
    """1200 seeded requests at temperature 1: the first token (prefill) and the second (a
    verify round with K = 2 from a draft that often disagrees) follow the target exactly,
    drafted by the verifier itself or by a draft service."""
    stack = request.getfixturevalue(stack_name)
    prompt = list(PROMPTS[0])

    def run(seed):
        return token_ids(stack.url, prompt, max_tokens=4, temperature=1.0, seed=seed,
                         speculation={"num_speculative_tokens": 3, "adaptive": False})  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, range(1200)))
    first, second = _target_first_two_token_distributions(stack.target_dir, prompt)
    assert _chi_square([o[0] for o in outputs], first) > 1e-3
    assert _chi_square([o[1] for o in outputs], second) > 1e-3
    # The same test has the power to tell the target's second-token marginal from its first.
    assert _chi_square([o[1] for o in outputs], first) < 1e-3


def check_second_tokens(target_dir, prompt: list[int], results: list[tuple[list[int], dict]]) -> None:
    """Sampled requests' (tokens, usage.speculation): their drafts were both kept and rejected,
    and their second tokens follow the target's exact marginal (and not its first token's
    distribution: the test can tell them apart)."""
    drafted = sum(usage["num_draft_tokens"] for _, usage in results)
    accepted = sum(usage["num_accepted_tokens"] for _, usage in results)
    assert 0.05 * drafted < accepted < 0.95 * drafted, (drafted, accepted)
    first, second = _target_first_two_token_distributions(target_dir, prompt)
    assert _chi_square([tokens[1] for tokens, _ in results], second) > 1e-3
    assert _chi_square([tokens[1] for tokens, _ in results], first) < 1e-3


def _copy_firing_prompt(target_dir, base: tuple[int, ...], mass: float = 0.99) -> tuple[list[int], float]:
    """A prompt ending in x in which [x, v, w] occurs earlier for each token v the target is
    likely to draw first, w being the target's likeliest token after v: the round after the
    prefill finds [x, t1] in the context, and its drafts start with a copy the target often
    keeps. With the share of first draws that find one."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    x, follows = base[-1], {}
    for _ in range(8):
        prompt = [*base[:-1], *(t for v, w in sorted(follows.items()) for t in (x, v, w)), x]
        with torch.no_grad():
            first = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
            likely = sorted(follows)
            covered = float(first[likely].sum()) if likely else 0.0
            if covered >= mass:
                return prompt, covered
            order = torch.argsort(first, descending=True)
            likely = sorted(set(likely) | set(order[: int((first[order].cumsum(0) < mass).sum()) + 1].tolist()))
            rows = torch.cat([torch.tensor(prompt).expand(len(likely), -1), torch.tensor(likely)[:, None]], dim=1)
            follows = dict(zip(likely, model(rows).logits[:, -1].argmax(-1).tolist()))
    raise AssertionError("no prompt found whose first draws nearly all repeat a bigram")


def test_sampled_tokens_stay_exact_when_drafts_start_with_a_copy(stack):
    """The round after the prefill drafts a copy of the context (one-hot, then the model's
    drafts) on nearly every request, and the target often keeps it; the second token still
    follows the target."""
    prompt, covered = _copy_firing_prompt(stack.target_dir, PROMPTS[0])
    assert covered >= 0.99

    def run(seed):  # four tokens: the round after the prefill drafts two (max_tokens leaves room for them)
        body = complete(stack.url, prompt=prompt, max_tokens=4, temperature=1.0, seed=seed, return_token_ids=True,
                        speculation={"num_speculative_tokens": 3, "adaptive": False})  # fmt: skip
        assert body["usage"]["speculation"]["num_draft_tokens"] >= 2
        return body["choices"][0]["token_ids"]

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, range(1000)))
    first, second = _target_first_two_token_distributions(stack.target_dir, prompt)
    assert _chi_square([o[1] for o in outputs], second) > 1e-3
    assert _chi_square([o[1] for o in outputs], first) < 1e-3  # the test can tell them apart


def test_seeded_request_is_reproducible_whatever_shares_its_batch(stack):
    body = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    alone = token_ids(stack.url, PROMPTS[2], **body)
    with ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(token_ids, stack.url, PROMPTS[i % 4], max_tokens=24, temperature=1.0) for i in range(5)]
        crowded = token_ids(stack.url, PROMPTS[2], **body)
        [future.result() for future in noise]
    assert crowded == alone
    assert token_ids(stack.url, PROMPTS[2], **{**body, "seed": 4321}) != alone


def test_openai_client_streams_completion_and_chat(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=model, prompt="def add(a, b):", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_timings": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.model_extra["speculation"]["num_drafts"] >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Write a loop."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    stream = list(
        client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stream=True)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert chat.usage.completion_tokens == 16


def test_stop_string_truncates_output(stack):
    text = complete(stack.url, prompt="abc", max_tokens=30, temperature=0)["choices"][0]["text"]
    stop = text[5:7]
    assert stop and text.find(stop) == 5, "pick a stop string that first occurs at offset 5"
    stopped = complete(stack.url, prompt="abc", max_tokens=30, temperature=0, stop=[stop])["choices"][0]
    assert stopped["text"] == text[:5] and stopped["finish_reason"] == "stop"


BAD_REQUESTS = [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "speculation": {"num_speculative_tokens": 0}}, 400, "speculation.num_speculative_tokens"),
    ({"prompt": "x", "speculation": {"num_speculative_tokens": 1000}}, 400, "speculation.num_speculative_tokens"),
    ({"prompt": "x", "speculation": {"method": "bogus"}}, 400, "speculation.method"),
    ({"prompt": "x", "speculation": {"tree": [[0], [1, 0]]}}, 400, "speculation.tree"),
    ({"prompt": "x", "speculation": {"tree": [2, 1], "method": "ngram"}}, 400, "speculation.tree"),
    ({"prompt": "x", "speculation": {"tree": [4, 4]}}, 400, "speculation.tree"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS)
def test_bad_input_gets_its_4xx_in_openai_shape(stack, body, status, param):
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_chat_and_malformed_json_then_still_serving(stack):
    assert httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": []}, timeout=30).status_code == 400
    reply = httpx.post(
        f"{stack.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400 and "error" in reply.json()
    assert httpx.get(f"{stack.url}/health").status_code == 200
    assert complete(stack.url, prompt="ok", max_tokens=3, temperature=0)["usage"]["completion_tokens"] == 3


def test_models_and_health(stack):
    models = httpx.get(f"{stack.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "target"
    health = httpx.get(f"{stack.url}/health").json()  # ready, and each part's state
    assert health == {"status": "ok", "verify": {stack.verify_address: "serving"}}


@pytest.mark.parametrize("draft_service", [False, True], ids=["verifier", "gateway"])
def test_mismatched_pair_is_refused_at_start_up(tmp_path, draft_service):
    """By the verifier that would draft with it, or by the gateway in front of a draft service."""
    from specserve.tools.testing import save_pair

    target_dir, draft_dir = save_pair(tmp_path, mismatched=True)
    command = up_command(target_dir, draft_dir, free_port(), free_port(), free_port(), draft_service=draft_service)
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "different vocabularies" in result.stderr
