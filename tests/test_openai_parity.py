"""What clients written for OpenAI's and vLLM's servers rely on, through the stack with the
openai client: usage of OpenAI's own counts, a streamed chunk per token, vLLM's fields and
routes (/invocations, /ping, a model by name), and the errors their tests match."""

from __future__ import annotations

import httpx
import openai
import pytest

SPECULATIVE = {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False}


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def test_usage_is_openais_three_counts_unless_speculation_is_asked(stack):
    client = _client(stack)
    plain = client.completions.create(model="target", prompt="def f(x):", max_tokens=5, temperature=0)
    prompt_tokens = len("def f(x):")  # the tiny tokenizer's tokens are bytes
    assert plain.usage == openai.types.CompletionUsage(
        completion_tokens=5, prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + 5
    )
    asked = client.completions.create(
        model="target", prompt="def f(x):", max_tokens=5, temperature=0, extra_body={"speculation": SPECULATIVE}
    )
    assert asked.usage.model_extra["speculation"]["num_drafts"] >= 1
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert set(chat.usage.model_dump(exclude_none=True)) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_a_stream_sends_a_chunk_per_token_and_continuous_usage(stack):
    """Speculative rounds make several tokens at once; the stream still sends them one by
    one, each choice's chunks counting up its usage where continuous_usage_stats asks."""
    client = _client(stack)
    stream = client.completions.create(
        model="target",
        prompt="ab ab ab ab ab",
        max_tokens=6,
        n=3,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"speculation": SPECULATIVE, "return_token_ids": True},
    )
    chunks = list(stream)
    per_choice: dict[int, list] = {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        per_choice[chunk.choices[0].index].append(chunk)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    for made in per_choice.values():
        assert [len(c.choices[0].model_extra["token_ids"]) for c in made] == [1] * 6
        assert [c.usage.completion_tokens for c in made] == [1, 2, 3, 4, 5, 6]
        assert made[-1].choices[0].finish_reason == "length" and made[0].usage.prompt_tokens == len("ab ab ab ab ab")


def test_logprobs_0_token_ids_as_names_and_stop_reasons(stack):
    client = _client(stack)
    zero = client.completions.create(
        model="target",
        prompt="def f(x):",
        max_tokens=4,
        temperature=0,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    logprobs = zero.choices[0].logprobs
    assert [list(top) for top in logprobs.top_logprobs] == [[token] for token in logprobs.tokens]
    named = client.completions.create(
        model="target",
        prompt="def f(x):",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    ids = named.choices[0].model_extra["token_ids"]
    assert ids == zero.choices[0].model_extra["token_ids"]
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert [next(iter(top)) for top in named.choices[0].logprobs.top_logprobs] == named.choices[0].logprobs.tokens
    text = zero.choices[0].text
    stopped = client.completions.create(
        model="target", prompt="def f(x):", max_tokens=4, temperature=0, stop=[text[1:3]]
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == text[1:3]
    by_id = client.completions.create(
        model="target", prompt="def f(x):", max_tokens=4, temperature=0, extra_body={"stop_token_ids": [ids[1]]}
    )
    assert by_id.choices[0].model_extra["stop_reason"] == ids[1] and by_id.choices[0].finish_reason == "stop"
    assert zero.choices[0].model_extra["stop_reason"] is None
    # A stop string inside a speculative round: a plain answer ends where the stream does.
    body = {
        "prompt": "ab ab ab ab ab ab",
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
        "speculation": SPECULATIVE,
    }
    whole = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    stop = whole["text"][3:5]
    plain = httpx.post(f"{stack.url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    streamed = list(
        client.completions.create(
            model="target",
            prompt=body["prompt"],
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "speculation": SPECULATIVE},
        )
    )
    streamed_ids = [t for chunk in streamed[:-1] for t in chunk.choices[0].model_extra["token_ids"]]
    assert plain["choices"][0]["token_ids"] == streamed_ids and plain["usage"]["completion_tokens"] == len(streamed_ids)
    assert plain["usage"]["completion_tokens"] == streamed[-1].usage.completion_tokens < 24


def test_chat_echo_continues_the_final_message_and_carries_prompt_fields_beside_the_choices(stack):
    client = _client(stack)
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    body = {
        "echo": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "return_token_ids": True,
        "prompt_logprobs": 1,
    }
    reply = client.chat.completions.create(
        model="target", messages=messages, max_tokens=4, temperature=0, extra_body=body
    )
    assert reply.choices[0].message.content.startswith("one two") and reply.choices[0].message.role == "assistant"
    prompt_ids = reply.model_extra["prompt_token_ids"]
    rendered = httpx.post(f"{stack.url}/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert rendered.endswith("one two")  # left open: no end of the assistant's turn
    assert len(reply.model_extra["prompt_logprobs"]) == len(prompt_ids)
    assert "prompt_token_ids" not in reply.choices[0].model_extra
    plain = client.chat.completions.create(
        model="target", messages=messages, max_tokens=4, temperature=0, extra_body={**body, "echo": False}
    )
    assert reply.choices[0].message.content == "one two" + plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model="target", messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
        )


def test_vllms_routes_invocations_ping_tokenize_and_a_model_by_name(stack):
    body = {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0}
    completion = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()
    invoked = httpx.post(f"{stack.url}/invocations", json=body, timeout=60).json()
    assert invoked.keys() == completion.keys() and invoked["choices"] == completion["choices"]
    assert completion["choices"][0]["prompt_logprobs"] is None and completion["system_fingerprint"] is None
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    chatted = httpx.post(f"{stack.url}/invocations", json=chat, timeout=60).json()
    assert chatted["object"] == "chat.completion" and chatted["prompt_logprobs"] is None
    assert httpx.post(f"{stack.url}/invocations", json={"max_tokens": 3}, timeout=60).status_code == 400
    assert httpx.get(f"{stack.url}/ping").status_code == 200 and httpx.post(f"{stack.url}/ping").status_code == 200
    assert httpx.get(f"{stack.url}/v1/models/target").json()["id"] == "target"
    assert httpx.get(f"{stack.url}/v1/models/other").status_code == 404
    messages = [{"role": "user", "content": "hi"}]
    opened = httpx.post(f"{stack.url}/tokenize", json={"messages": messages}).json()
    closed = httpx.post(f"{stack.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert closed["count"] < opened["count"] and opened["tokens"][: closed["count"]] == closed["tokens"]
    strings = httpx.post(f"{stack.url}/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert strings["token_strs"] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": [3, 100000]}, ["out of vocabulary"]),
        ({"seed": 2**63}, ["less_than_equal"]),
        ({"seed": -(2**63) - 1}, ["greater_than_equal"]),
        ({"logit_bias": {"bad1": 5, "bad2": 5}}, ["bad1", "bad2"]),
        ({"logit_bias": {"--5": 1}}, ["--5"]),
        ({"stop_token_ids": [100000]}, ["100000", "257"]),
    ],
)
def test_errors_name_what_vllms_tests_look_for(stack, body, words):
    reply = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=60)
    assert reply.status_code == 400 and all(word in reply.json()["error"]["message"] for word in words), reply.text


def test_a_negative_seed_the_right_side_of_truncation_and_special_tokens_kept(stack):
    def complete(**body) -> dict:
        reply = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={"max_tokens": 3, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    first = complete(prompt="hello", seed=-5, temperature=1.0)
    assert complete(prompt="hello", seed=-5, temperature=1.0)["choices"] == first["choices"]
    right = complete(
        prompt=[1, 2, 3, 4, 5, 6], truncate_prompt_tokens=2, truncation_side="right", return_token_ids=True
    )
    assert right["choices"][0]["prompt_token_ids"] == [1, 2] and right["usage"]["prompt_tokens"] == 2
    kept = complete(prompt="hi", max_tokens=2, allowed_token_ids=[256], ignore_eos=True, skip_special_tokens=False)
    assert kept["choices"][0]["text"] == "<|endoftext|>" * 2
    assert complete(prompt="hi", max_tokens=2, allowed_token_ids=[256], ignore_eos=True)["choices"][0]["text"] == ""
