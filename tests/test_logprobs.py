"""Logprobs through the stack, with the openai client: the same to the bit speculative and
target-only, completions and chat, whole and streamed; echo and max_tokens 0 score a prompt
as transformers does; bad settings are a 400."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_e2e import PROMPTS

SPECULATIVE = (
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
    {"method": "lookahead"},
)


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def _completion(client, prompt, speculation: dict, stream: bool = False, **body):
    extra = {"speculation": speculation, "return_token_ids": True}
    if not stream:
        return client.completions.create(
            model="target", prompt=list(prompt), max_tokens=24, temperature=0, logprobs=3, extra_body=extra, **body
        )
    chunks = list(
        client.completions.create(
            model="target",
            prompt=list(prompt),
            max_tokens=24,
            temperature=0,
            logprobs=3,
            extra_body=extra,
            stream=True,
            **body,
        )
    )
    tokens, values, tops = [], [], []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
    return tokens, values, tops


def test_greedy_logprobs_are_the_same_to_the_bit_speculative_and_target_only(stack):
    client = _client(stack)
    for prompt in PROMPTS:
        plain = _completion(client, prompt, {"method": "none"}).choices[0]
        assert len(plain.logprobs.token_logprobs) == len(plain.model_extra["token_ids"])
        assert all(1 <= len(top) <= 4 for top in plain.logprobs.top_logprobs)  # the top 3 and the chosen, by text
        for token, value, top in zip(plain.logprobs.tokens, plain.logprobs.token_logprobs, plain.logprobs.top_logprobs):
            assert top[token] == value and value <= 0 and max(top.values()) >= value
        for speculation in SPECULATIVE:
            drafted = _completion(client, prompt, speculation).choices[0]
            assert drafted.model_extra["token_ids"] == plain.model_extra["token_ids"], speculation
            assert drafted.logprobs.token_logprobs == plain.logprobs.token_logprobs, speculation  # bit-identical
            assert drafted.logprobs.top_logprobs == plain.logprobs.top_logprobs, speculation
        streamed = _completion(client, prompt, SPECULATIVE[0], stream=True)
        assert streamed == (plain.logprobs.tokens, plain.logprobs.token_logprobs, plain.logprobs.top_logprobs)


def test_chat_logprobs_parse_whole_and_streamed(stack):
    client = _client(stack)
    messages = [{"role": "user", "content": "hello"}]
    common = {
        "model": "target",
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = client.chat.completions.create(**common, extra_body={"speculation": {"method": "none"}})
    content = plain.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    drafted = client.chat.completions.create(**common, extra_body={"speculation": SPECULATIVE[0]})
    assert [e.logprob for e in drafted.choices[0].logprobs.content] == [e.logprob for e in content]
    chunks = client.chat.completions.create(**common, stream=True, extra_body={"speculation": SPECULATIVE[1]})
    streamed = [e.logprob for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == [e.logprob for e in content]


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does(stack):
    """A log-likelihood request (lm-evaluation-harness's): each prompt token's logprob after
    the ones before it, within 0.02 nats of transformers' float32 log-softmax."""
    prompt = [5, 17, 99, 3, 42, 42, 7, 250, 1, 64, 64, 64]
    reply = _client(stack).completions.create(
        model="target", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(prompt)
    model = AutoModelForCausalLM.from_pretrained(stack.target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    expected = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor(choice.logprobs.token_logprobs[1:])
    assert (got - expected).abs().max() < 0.02, (got - expected).abs().max()
    # echo beside a completion: the prompt's text, then the completion's; the prompt's logprobs first
    both = _client(stack).completions.create(
        model="target", prompt=prompt, max_tokens=5, echo=True, logprobs=1, temperature=0
    )
    assert both.choices[0].logprobs.token_logprobs[: len(prompt)] == choice.logprobs.token_logprobs
    assert len(both.choices[0].logprobs.token_logprobs) == len(prompt) + both.usage.completion_tokens
    # vLLM's prompt_logprobs: the same values, with ranks
    vllm = httpx.post(
        f"{stack.url}/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0},
    ).json()
    entries = vllm["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for token, entry, value in zip(prompt[1:], entries[1:], choice.logprobs.token_logprobs[1:]):
        assert entry[str(token)]["logprob"] == value and entry[str(token)]["rank"] >= 1 and len(entry) in (2, 3)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "a"}], "logprobs": 3}, "logprobs"),
    ],
)
def test_bad_logprob_settings_are_a_400_naming_the_field(stack, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_vllm_endpoints_request_ids_and_the_model_list(stack):
    tokens = httpx.post(f"{stack.url}/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) >= 1 and tokens["max_model_len"] == 512
    assert httpx.post(f"{stack.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello"}
    bad = httpx.post(f"{stack.url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    chat = httpx.post(f"{stack.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    assert httpx.get(f"{stack.url}/version").json()["version"]
    card = httpx.get(f"{stack.url}/v1/models").json()["data"][0]
    assert card["root"] == card["id"] and card["max_model_len"] == 512
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "model": ""}  # an empty model is the served one
    sent = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert sent.status_code == 200 and sent.headers["x-request-id"] == "abc-123"
    made = httpx.post(f"{stack.url}/v1/completions", json=body)
    assert len(made.headers["x-request-id"]) == 32
    refused = httpx.post(f"{stack.url}/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def test_n_choices_with_a_seed_reproduce_whole_and_streamed(stack):
    client = _client(stack)
    body = {
        "model": "target",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 7,
        "n": 4,
        "extra_body": {"return_token_ids": True, "speculation": SPECULATIVE[1]},
    }
    first = client.completions.create(**body)
    again = client.completions.create(**body)
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3]
    tokens = [c.model_extra["token_ids"] for c in sorted(first.choices, key=lambda c: c.index)]
    assert tokens == [c.model_extra["token_ids"] for c in sorted(again.choices, key=lambda c: c.index)]
    assert len({tuple(t) for t in tokens}) > 1  # the choices draw with seeds of their own
    assert first.usage.completion_tokens == sum(len(t) for t in tokens) and first.usage.prompt_tokens == 4
    one = client.completions.create(**{**body, "n": 1})
    assert one.choices[0].model_extra["token_ids"] == tokens[0]  # choice 0 is the request's seed
    streamed: dict[int, list[int]] = {}
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
    assert [streamed[i] for i in range(4)] == tokens


def test_stop_strings_in_the_output_and_truncated_prompts(stack):
    client = _client(stack)
    whole = client.completions.create(model="target", prompt=[1, 2, 3], max_tokens=16, temperature=0)
    text = whole.choices[0].text
    stop = text[3:5] if len(text) >= 5 else None
    if stop:  # the same request stopped at a string of its own output: the string kept, or not
        cut = client.completions.create(model="target", prompt=[1, 2, 3], max_tokens=16, temperature=0, stop=[stop])
        kept = client.completions.create(
            model="target",
            prompt=[1, 2, 3],
            max_tokens=16,
            temperature=0,
            stop=[stop],
            extra_body={"include_stop_str_in_output": True},
        )
        assert kept.choices[0].text == cut.choices[0].text + stop and text.startswith(kept.choices[0].text)
    truncated = client.completions.create(
        model="target",
        prompt=[9, 9, 9, 1, 2, 3],
        max_tokens=16,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert truncated.usage.prompt_tokens == 3 and truncated.choices[0].text == text


def test_a_batch_of_prompts_is_a_choice_per_prompt_and_sample(stack):
    client = _client(stack)
    batch = [[1, 2, 3], [7, 8, 9, 10]]
    reply = client.completions.create(
        model="target", prompt=batch, max_tokens=6, temperature=0, n=2, extra_body={"return_token_ids": True}
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3] and reply.usage.prompt_tokens == 7
    by_index = {c.index: c.model_extra["token_ids"] for c in reply.choices}
    for number, prompt in enumerate(batch):
        alone = client.completions.create(
            model="target", prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
        )
        assert by_index[2 * number] == by_index[2 * number + 1] == alone.choices[0].model_extra["token_ids"]
    texts = client.completions.create(model="target", prompt=["ab", "cd"], max_tokens=3, temperature=0, echo=True)
    assert [c.text[:2] for c in sorted(texts.choices, key=lambda c: c.index)] == ["ab", "cd"]


def test_greedy_choices_are_the_single_choice_output_on_a_long_prompt(stack):
    """Greedy choices each prefill the prompt themselves (as the first does): all are the one
    target-only output, also where the prefill runs eager (over 16 tokens)."""
    client = _client(stack)
    prompt = list(range(40, 70))
    alone = (
        client.completions.create(
            model="target", prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    three = client.completions.create(
        model="target", prompt=prompt, max_tokens=8, temperature=0, n=3, extra_body={"return_token_ids": True}
    )
    assert [c.model_extra["token_ids"] for c in three.choices] == [alone] * 3


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_a_prompt_is_scored_in_chunks_and_in_float32_where_the_matrices_are_16_bit(
    tiny_pair, monkeypatch, matmul_dtype
):
    """The verifier scores a prompt chunk by chunk (never its whole [prompt, vocab] logits),
    from float32 matrices where its own are bfloat16: within 1e-4 nats of transformers'
    float32 forward, where the bfloat16 products are further off. What follows the prompt is
    what a plain prefill makes, to the bit: float32 scoring writes the cache again; without
    it, the chunks are a plain prefill's (max_batched_tokens each)."""
    from specserve.model.loading import load_model
    from specserve.sampling import SamplingParams
    from verify_service import scoring
    from verify_service.config import VerifyConfig
    from verify_service.engine import Verifier
    from verify_service.jobs import PrefillJob

    target_dir, _ = tiny_pair
    prompt = tuple((7 * i * i + 3 * i) % 256 for i in range(40))
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    reference = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    greedy = SamplingParams(temperature=0, logprobs=True, top_logprobs=2)

    def verifier(precise: bool) -> Verifier:
        loaded = load_model(
            str(target_dir), torch.device("cpu"), torch.float32, matmul_dtype=matmul_dtype, precise_scoring=precise
        )
        return Verifier(loaded, VerifyConfig(max_batched_tokens=16), None, None)  # prompts in chunks of 16

    def scored(engine: Verifier, session: str):
        outcome = engine.step([PrefillJob(session, prompt, greedy, prompt_logprobs=2)])[0]
        assert not isinstance(outcome, Exception), outcome
        return torch.tensor([r.logprob for r in outcome.prompt_logprobs]), outcome

    monkeypatch.setattr(scoring, "SCORE_CHUNK_TOKENS", 12)  # float32 scoring: four chunks
    precise = verifier(True)
    values, outcome = scored(precise, "chunked")
    assert len(outcome.prompt_logprobs) == len(prompt) - 1 and all(
        len(r.top_token_ids) == 2 for r in outcome.prompt_logprobs
    )
    assert (values - reference).abs().max() < 1e-4
    plain = precise.step([PrefillJob("plain", prompt, greedy)])[0]
    assert (outcome.next_token_id, outcome.logprobs) == (plain.next_token_id, plain.logprobs)  # to the bit
    monkeypatch.setattr(scoring, "SCORE_CHUNK_TOKENS", 512)  # one chunk: the same values, to rounding
    assert (scored(precise, "whole")[0] - values).abs().max() < 1e-5
    if matmul_dtype == "bfloat16":  # the float32 copy is what makes the difference
        assert precise.backend.scores_precisely
        products, _ = scored(verifier(False), "bf16")
        assert (products - reference).abs().max() > 1e-3
