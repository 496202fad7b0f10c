"""Logits processing (penalties, biases, masks): its arithmetic, and through the stack greedy
output equal speculative and target-only, sampled output exact with a presence penalty and
a draft that disagrees with the target."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.errors import InvalidArgument
from specserve.logit_processing import LogitProcessing
from specserve.serving.batching import Again
from tests.test_e2e import PROMPTS, _chi_square, complete


def test_penalties_biases_and_masks_follow_vllms_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 3)
    processing = LogitProcessing(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias=((4, 10.0),),
        min_tokens=3,
        stop_token_ids=(2,),
    )
    # prompt [1]; output [3, 3]; row r adds the round's tokens before it: [], [0], [0, 4]
    out = processing.apply(logits, prompt=[1], output=[3, 3], added=[[], [0], [0, 4]], eos=(0,))
    row0 = [float("-inf"), -2.0, float("-inf"), 1.5 - 0.5 - 0.5, 11.0]  # 3: 3/2, then -0.25*2 - 0.5
    assert out[0].tolist() == row0  # output holds 2 tokens < 3: end-of-sequence (0) and stop id 2 masked
    assert out[1][0] == 2.0 / 2 - 0.25 - 0.5  # 3 tokens: nothing masked; 0 once in the output
    assert out[1][1] == -2.0 and out[1][2] == 0.5 and out[1][4] == 11.0
    assert out[2][0] == 2.0 / 2 - 0.25 - 0.5
    assert out[2][4] == 11.0 / 2 - 0.25 - 0.5 and out[2][2] == 0.5  # 2: neither seen nor masked
    allowed = LogitProcessing(allowed_token_ids=(1, 3)).apply(logits[:1], [], [], [[]], eos=(0,))
    assert torch.isinf(allowed[0, [0, 2, 4]]).all() and allowed[0, 3] == 3.0
    bad = LogitProcessing(bad_words=((3,), (1, 4), (2, 1, 0))).apply(logits[:2], [], [1], [[], [2]], eos=(0,))
    assert torch.isinf(bad[0, [3, 4]]).all() and not torch.isinf(bad[0, [0, 1, 2]]).any()  # after [1]: 4 completes
    assert torch.isinf(bad[1, [3]]).all() and not torch.isinf(bad[1, [0, 4]]).any()  # after [1, 2]: nothing but 3
    nothing_left = LogitProcessing(allowed_token_ids=(3,), bad_words=((3,),)).apply(logits[:1], [], [], [[]], (0,))
    assert nothing_left[0].tolist() == logits[0].tolist()  # no token left: the row keeps its logits
    only_ends = LogitProcessing(allowed_token_ids=(0,), min_tokens=5).apply(logits[:1], [], [], [[]], eos=(0,))
    assert only_ends[0, 0] == 2.0  # no row is left without a token to draw
    beyond = LogitProcessing(logit_bias=((2, 1.0), (9, 5.0)), allowed_token_ids=(2, 3, 9), bad_words=((9,),))
    assert beyond.apply(logits[:1], [], [1, 8], [[9]], eos=(0,))[0, 2] == 1.5  # ids past these logits: left out
    with pytest.raises(InvalidArgument, match="presence_penalty"):
        LogitProcessing(presence_penalty=3)


PENALTIES = {"presence_penalty": 1.2, "frequency_penalty": 0.4, "repetition_penalty": 1.3, "logit_bias": {"42": 3.0}}


def _complete(url: str, prompt, speculation: dict, **body) -> dict:
    fields = {"max_tokens": 24, "temperature": 0, "return_token_ids": True, "speculation": speculation, **body}
    return complete(url, prompt=list(prompt), **fields)


def test_greedy_output_with_penalties_and_biases_is_target_onlys(stack):
    methods = (
        {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        {"method": "lookahead"},
    )
    changed = 0
    for prompt in PROMPTS:
        plain = _complete(stack.url, prompt, {"method": "none"})["choices"][0]["token_ids"]
        reference = _complete(stack.url, prompt, {"method": "none"}, **PENALTIES)["choices"][0]["token_ids"]
        changed += reference != plain
        for speculation in methods:
            body = _complete(stack.url, prompt, speculation, **PENALTIES, logprobs=2)
            assert body["choices"][0]["token_ids"] == reference, (prompt, speculation)
        masked = _complete(stack.url, prompt, methods[0], allowed_token_ids=[7, 8, 9], min_tokens=24)
        assert set(masked["choices"][0]["token_ids"]) <= {7, 8, 9} and len(masked["choices"][0]["token_ids"]) == 24
    assert changed >= 3  # the penalties change the output: the test compares processed outputs


def _penalised_first_two_token_distributions(target_dir, prompt: list[int], presence: float):
    """p(t1 | prompt) and the marginal of t2, t1 penalised as an output token at t2."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        vocab = first.shape[0]
        extended = torch.cat([torch.tensor(prompt).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        logits = model(extended).logits[:, -1].double()  # [t1, t2]
        logits[torch.arange(vocab), torch.arange(vocab)] -= presence
    return first, first @ logits.softmax(-1)


def test_sampled_output_with_a_presence_penalty_follows_the_processed_target(stack):
    """600 seeded requests at temperature 1 with presence_penalty 2 and the tiny draft (a
    random model that disagrees with the target): the second token follows the penalised
    target's marginal, and not the unpenalised one. On this prompt the tiny target repeats
    its first token about a third of the time, which the penalty makes rare."""
    prompt = [72] * 8

    def run(seed):
        body = _complete(
            stack.url,
            prompt,
            {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
            max_tokens=4,
            temperature=1.0,
            seed=seed,
            presence_penalty=2.0,
        )
        return body["choices"][0]["token_ids"], body["usage"]["speculation"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(600)))
    drafted = sum(usage["num_draft_tokens"] for _, usage in results)
    assert sum(usage["num_accepted_tokens"] for _, usage in results) < 0.95 * drafted  # drafts rejected too
    first, penalised = _penalised_first_two_token_distributions(stack.target_dir, prompt, 2.0)
    _, plain = _penalised_first_two_token_distributions(stack.target_dir, prompt, 0.0)
    seconds = [tokens[1] for tokens, _ in results]
    assert _chi_square(seconds, penalised) > 1e-3
    assert _chi_square(seconds, plain) < 1e-3  # the test can tell the penalty's effect


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": [300]}, "allowed_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_processing_settings_are_a_400_naming_the_field(stack, body, param):
    reply = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "a", **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_ignore_eos_goes_on_and_bad_words_are_never_completed(stack):
    forced = {"logit_bias": {"256": 100}}  # the tiny target's end-of-sequence, every time
    method = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
    stopped = _complete(stack.url, [1, 2], method, **forced)
    assert stopped["choices"][0]["token_ids"] == [256] and stopped["choices"][0]["finish_reason"] == "stop"
    for speculation in (method, {"method": "none"}):
        going = _complete(stack.url, [1, 2], speculation, ignore_eos=True, max_tokens=7, **forced)
        assert going["choices"][0]["token_ids"] == [256] * 7 and going["choices"][0]["finish_reason"] == "length"
    plain = _complete(stack.url, PROMPTS[0], {"method": "none"})["choices"][0]
    word = plain["text"][:3].strip() or plain["text"][:3]
    banned = [
        _complete(stack.url, PROMPTS[0], speculation, bad_words=[word])["choices"][0]
        for speculation in (
            {"method": "none"},
            method,
            {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        )
    ]
    assert banned[0]["token_ids"] == banned[1]["token_ids"] == banned[2]["token_ids"] != plain["token_ids"]
    assert word not in banned[0]["text"]


def test_masked_tokens_logprobs_are_finite_and_one_request_holds_at_most_16_sessions(stack):
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "allowed_token_ids": [7, 8], "logprobs": 5}
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text  # -inf would not be JSON
    tops = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(min(top.values()) == -9999.0 for top in tops)
    many = httpx.post(f"{stack.url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 6}, timeout=60)
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"


def _decode_with(verifier, session: str, prompt: tuple[int, ...], sampling, speculation, max_tokens: int) -> list:
    """Every Outcome of a decode after the prefill, run batch by batch to its end."""
    from verify_service.jobs import DecodeJob, PrefillJob

    verifier.step([PrefillJob(session, prompt, sampling)])
    made = []
    job = DecodeJob(session, len(prompt) + 1, max_tokens, None, made.append, threading.Event(), speculation=speculation)
    while isinstance(result := verifier.step([job])[0], Again):
        job = result.item
    assert not isinstance(result, Exception), result
    return made


@pytest.mark.parametrize("method", ["draft_model", "draft_model_tree"])
def test_a_draft_processed_as_the_target_is_accepted_whole(tiny_pair, method):
    """The draft is the target itself: with its logits processed as the verifier processes
    the target's (the output and the round's drafts before each position counted), every
    greedy draft holds; left unprocessed, the penalties reject some."""
    from specserve.drafting import Drafter, DraftOptions
    from specserve.methods.trees import TreeShape
    from specserve.model.loading import load_model
    from specserve.sampling import SamplingParams
    from specserve.speculation import Speculation
    from verify_service.config import VerifyConfig
    from verify_service.engine import Verifier
    from verify_service.local_drafts import LocalDrafting

    target_dir, _ = tiny_pair
    target = load_model(str(target_dir), torch.device("cpu"), torch.float32)
    draft = load_model(str(target_dir), torch.device("cpu"), torch.float32, row_invariant=False)

    def verifier(process: bool) -> Verifier:
        config = VerifyConfig(process_draft_logits=process)
        return Verifier(
            target, config, None, LocalDrafting(Drafter({"draft_model": draft}, DraftOptions.of(config, target)), 16)
        )

    processing = LogitProcessing(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.5)
    penalised = SamplingParams(temperature=0, processing=processing)
    tree = TreeShape.parse([2, 1, 1]) if method.endswith("tree") else None
    speculation = Speculation("draft_model", len(tree) if tree else 3, adaptive=False, tree=tree)
    prompt = (104, 105, 104, 105, 104, 105, 32, 7)

    def rounds(engine: Verifier, session: str) -> list:
        return _decode_with(engine, session, prompt, penalised, speculation, 30)

    def tokens(outcomes) -> list[int]:
        return [t for o in outcomes for t in (*o.accepted_token_ids, o.next_token_id)]

    reference = tokens(_decode_with(verifier(False), "none", prompt, penalised, None, 30))
    processed = rounds(verifier(True), "processed")
    assert tokens(processed) == reference
    assert len(processed) <= 30 // 4 + 1  # 3 drafts and a token a round: every draft held
    unprocessed = rounds(verifier(False), "unprocessed")  # the default: drafts unprocessed
    assert tokens(unprocessed) == reference  # still exact: only fewer drafts hold
    assert sum(o.num_accepted for o in unprocessed) < sum(o.num_accepted for o in processed)


@pytest.mark.parametrize(("rows", "vocab", "entries"), [(5, 300, 40), (1, 1000, 1), (3, 257, 0), (4, 2100, 700)])
def test_the_penalties_kernel_equals_its_reference_and_the_dense_arithmetic(rows, vocab, entries):
    """The Triton kernel (on CUDA where there is one, else under TRITON_INTERPRET) gives the
    reference's penalised logits to the bit, and the reference is vLLM's dense arithmetic:
    only the entries' logits change."""
    import os

    from specserve_kernels.penalties_reference import apply_penalties_reference

    generator = torch.Generator().manual_seed(rows * vocab + entries)
    scores = torch.randn(rows, vocab, generator=generator) * 3
    scores[0, :5] = float("-inf")  # masked logits stay masked
    flat = torch.randperm(rows * vocab, generator=generator)[:entries]  # distinct (row, token) pairs
    row_ids, token_ids = flat // vocab, flat % vocab
    counts = torch.randint(0, 4, (entries,), generator=generator).float()
    seen = ((counts > 0) | (torch.rand(entries, generator=generator) < 0.3)).to(torch.uint8)
    args = (row_ids, token_ids, counts, seen, 0.4, 0.25, 1.3)
    expected = apply_penalties_reference(scores.clone(), *args)
    dense_counts = torch.zeros(rows, vocab)
    dense_counts[row_ids, token_ids] = counts
    dense_seen = torch.zeros(rows, vocab, dtype=torch.bool)
    dense_seen[row_ids, token_ids] = seen.bool()
    dense = torch.where(dense_seen, torch.where(scores > 0, scores / 1.3, scores * 1.3), scores)
    dense = dense - 0.25 * dense_counts - 0.4 * (dense_counts > 0).float()
    assert torch.equal(expected, dense)
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs Triton (CUDA or TRITON_INTERPRET=1)")
    from specserve_kernels.penalties_triton import apply_penalties_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = [t.to(device) for t in (scores.clone(), *args[:4])]
    assert torch.equal(apply_penalties_triton(*moved, *args[4:]).cpu(), expected)
