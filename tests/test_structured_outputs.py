"""Structured outputs (specserve/grammar.py): the grammar's state and masks, and through the
stack, outputs that validate under every method, greedy output equal to target-only under
the same schema, choices, and sampled output that follows the grammar-masked target."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.errors import InvalidArgument
from specserve.grammar import Grammar, Grammars
from specserve.methods.ngram import ngram_drafts
from specserve.protocol import SparseDistribution
from specserve.sampling import SamplingParams
from tests.test_e2e import _chi_square, complete
from verify_service.grammar_rounds import trim_drafts

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
METHODS = [
    {"method": "none"},
    {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "medusa", "num_speculative_tokens": 3, "adaptive": False},
    {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": True},
    {"method": "draft_model", "tree": [2, 1], "adaptive": False},
    {"method": "lookahead"},
]
PROMPTS = ["Reply in JSON: ", "status: ", "{", "The answer is"]
LETTERS = "abcdefgh"


@pytest.fixture(scope="module")
def grammars(tiny_pair):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    return tokenizer, Grammars(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def test_a_state_masks_each_path_and_looks_ahead_without_moving(grammars):
    tokenizer, compiled = grammars
    state = compiled.start(Grammar.json_schema(SCHEMA, compact=True))
    assert tokenizer.decode(state.forced()) == '{"ok": '  # a key the schema leaves no choice of
    text = tokenizer.encode('{"ok": true, "n": 12, "tag": "red"}', add_special_tokens=False)
    bad = [*text[:3], tokenizer.encode("x", add_special_tokens=False)[0]]
    assert state.legal(text) == len(text) and state.legal(bad) == 3
    masks = state.masks([[], text[:7], bad, text])  # [4, vocab]
    assert masks[0].sum() == 1 and masks[0, text[0]]
    assert set(masks[1].nonzero().flatten().tolist()) == set(tokenizer.encode("tf", add_special_tokens=False))
    assert masks[2].all()  # a refused path: its row is never read
    assert masks[3].nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # done: only the end
    assert state.legal(text) == len(text)  # looking ahead left the state where it was
    assert state.advance(text) and state.forced() == []
    assert state.advance([tokenizer.eos_token_id]) and state.masks([[]]).all()  # past the end (ignore_eos): free


def test_grammars_refuse_what_the_library_refuses_and_cache_by_text(grammars):
    _, compiled = grammars
    for bad, words in [(Grammar("regex", "(a|"), "unclosed group"), (Grammar.json_schema({"type": "strin"}), "strin"),
                       (Grammar("lark", "start: nothing_defined"), "nothing_defined")]:  # fmt: skip
        with pytest.raises(InvalidArgument, match=words):
            compiled.start(bad)
    with pytest.raises(InvalidArgument, match="not JSON"):
        Grammar.json_schema("{not json")
    choice = Grammar.choice(['say "yes"', "no"])
    assert compiled.compiled(choice) is not compiled.compiled(choice)  # each caller its own copy
    assert list(compiled._compiled)[-1] == choice and choice in compiled._compiled
    with pytest.raises(InvalidArgument, match="does not follow"):
        compiled.start(choice, [ord("x")])


class _Row:
    def __init__(self, state, drafts, greedy, widths=()):
        self.session = type("S", (), {"grammar": state})
        self.drafts, self.feed = tuple(drafts), [0, *drafts]
        self.sampling = SamplingParams(temperature=0.0 if greedy else 1.0)
        self.distributions = tuple(
            SparseDistribution(tuple(range(d, d + w)), (1 / w,) * w) for d, w in zip(drafts, widths)
        )


def test_drafts_are_cut_after_the_first_the_grammar_refuses(grammars):
    """Greedy or one-hot: cut before it (the bonus at its place is the same draw). A sampled
    q of wider support: it stays, for the rule to reject, and nothing after it is fed."""
    tokenizer, compiled = grammars
    a, x = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "ax")
    for greedy, widths, kept in [(True, (), 2), (False, (1, 1, 1, 1), 2), (False, (1, 1, 3, 1), 3)]:
        row = _Row(compiled.start(Grammar("regex", "a+")), [a, a, x, a], greedy, widths)
        trim_drafts(row)
        assert row.drafts == (a, a, x, a)[:kept] and row.feed == [0, a, a, x][: kept + 1]
        assert len(row.distributions) == (0 if greedy else kept)


def _structured(url: str, prompt: str, speculation: dict, **body) -> str:
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "speculation": speculation, **body}
    reply = complete(url, **body)
    assert reply["choices"][0]["finish_reason"] == "stop", (speculation, body, reply["choices"][0]["text"])
    return reply["choices"][0]["text"]


def test_outputs_validate_under_every_method_greedy_and_sampled(stack):
    compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}  # the tiny random model loves whitespace
    asks = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": compact, "strict": True}}},
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"guided_json": json.dumps(compact)},
    ]
    jobs = [(prompt, method, ask, temperature) for prompt in PROMPTS for method in METHODS for ask in asks
            for temperature in (0, 0.8)]  # fmt: skip

    def run(job):
        prompt, method, ask, temperature = job
        return job, _structured(stack.url, prompt, method, temperature=temperature, seed=7, **ask)

    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(run, jobs))
    for _, text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    greedy = {}
    for (prompt, method, ask, temperature), text in outputs:
        if temperature == 0:
            greedy.setdefault((prompt, json.dumps(ask)), {})[json.dumps(method)] = text
    for by_method in greedy.values():  # speculation changes no greedy token under the grammar
        assert len(set(by_method.values())) == 1, by_method


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_greedy_speculation_equals_target_only_token_for_token(request, stack_name):
    """A grammar with choices at every step (regex), so that drafts are rejected too, with
    and without penalties; drafted by the verifier itself (its drafts' q masked) or by a
    draft service (which is not told the grammar: its drafts are cut in the verifier)."""
    stack = request.getfixturevalue(stack_name)
    methods = METHODS[1:] if stack_name == "stack" else METHODS[1:3]
    for prompt, penalties in zip(PROMPTS, ({}, {"presence_penalty": 1.5}, {}, {"frequency_penalty": 1.0})):
        ask = {"structured_outputs": {"regex": "[a-h ]{5,40}\\."}, "return_token_ids": True, **penalties}
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, **ask}
        reference = complete(stack.url, speculation={"method": "none"}, **body)["choices"][0]
        assert reference["finish_reason"] == "stop"
        for method in methods:
            reply = complete(stack.url, speculation=method, **body)
            assert reply["choices"][0]["token_ids"] == reference["token_ids"], method
            assert reply["usage"]["speculation"]["num_draft_tokens"] > 0 or method.get("adaptive", True)


def test_vllm_and_openai_structured_requests_are_served(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    choices = ["positive", "negative", "neutral"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        for temperature in (0, 1.0):
            reply = client.completions.create(model="target", prompt="Sentiment:", max_tokens=16,
                                              temperature=temperature, extra_body=extra)  # fmt: skip
            assert reply.choices[0].text in choices
    chat = client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "JSON please"}], max_tokens=64, temperature=0,
        response_format={"type": "json_object"}, extra_body={"structured_outputs": None},
    )  # fmt: skip
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "y=" [0-9] [0-9]? ";"'
    for grammar, pattern in ((lark, "x="), (gbnf, "y=")):
        text = client.completions.create(model="target", prompt="set ", max_tokens=16, temperature=0.7,
                                         extra_body={"guided_grammar": grammar}).choices[0].text  # fmt: skip
        assert text.startswith(pattern) and text.endswith(";") and text[2:-1].isdigit()
    regex = client.completions.create(model="target", prompt="id ", max_tokens=16, temperature=1.0,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"}).choices[0].text  # fmt: skip
    assert len(regex) == 6 and regex[3] == "-" and regex[:3].isupper() and regex[4:].isdigit()
    reply = httpx.post(
        f"{stack.url}/v1/completions", json={"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_outputs"


def _masked_target(target_dir, prompt: list[int], legal: list[int]):
    """p1 and the second token's marginal of the target masked to legal (both positions),
    and the marginal where the rejected draft's residual is left unmasked (ngram's drafts)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double()
        rows = torch.cat([torch.tensor(prompt).expand(len(legal), -1), torch.tensor(legal)[:, None]], dim=1)
        second = model(rows).logits[:, -1].double()  # [legal t1, vocab]
    mask = torch.full_like(first, float("-inf"))
    mask[legal] = 0
    p1 = (first + mask).softmax(-1)
    p2 = (second + mask).softmax(-1)  # [legal t1, vocab]
    unmasked = second.softmax(-1)
    correct = (p1[legal, None] * p2).sum(0)
    mutant = torch.zeros_like(correct)
    for i, t1 in enumerate(legal):
        draft = ngram_drafts([*prompt, t1], 1, 4)
        if not draft or draft[0] not in legal:  # no draft, or cut: the bonus draw from p2
            mutant += p1[t1] * p2[i]
            continue
        d = draft[0]
        residual = unmasked[i].clone()
        residual[d] = 0
        mutant[d] += p1[t1] * p2[i, d]
        mutant += p1[t1] * (1 - p2[i, d]) * residual / residual.sum()
    return correct, mutant


@pytest.mark.parametrize(
    "speculation",
    [{"method": "ngram", "num_speculative_tokens": 2, "adaptive": False},
     {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False},
     {"method": "draft_model", "tree": [2, 1], "adaptive": False}],
    ids=["ngram", "draft_model", "tree"],
)  # fmt: skip
def test_sampled_output_under_a_grammar_follows_the_masked_target(stack, speculation):
    """Seeded requests (600 or 400) at temperature 1 under a two-letter grammar, from a
    prompt where every letter has been followed by another: ngram drafts copies, some of
    which the grammar cuts; the draft model draws from its grammar-masked q, as a chain and
    as a tree. The second token follows the masked target's marginal; for ngram, not the one
    a residual left unmasked would give."""
    tokenizer = AutoTokenizer.from_pretrained(stack.target_dir)
    legal = tokenizer.encode(LETTERS, add_special_tokens=False)
    prompt = tokenizer.encode("ahbgcfdeedfcgbhaq", add_special_tokens=False)

    def run(seed):
        body = complete(stack.url, prompt=prompt, max_tokens=6, temperature=1.0, seed=seed, return_token_ids=True,
                        speculation=speculation, structured_outputs={"regex": f"[{LETTERS}][{LETTERS}]"})  # fmt: skip
        return body["choices"][0]["token_ids"], body["usage"]["speculation"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(600 if speculation["method"] == "ngram" else 400)))
    assert all(len(tokens) == 3 and tokens[2] == tokenizer.eos_token_id for tokens, _ in results)
    drafted = sum(usage["num_draft_tokens"] for _, usage in results)
    assert drafted >= 300 and 0 < sum(usage["num_accepted_tokens"] for _, usage in results) < drafted  # both ways
    correct, mutant = _masked_target(stack.target_dir, prompt, legal)
    seconds = [tokens[1] for tokens, _ in results]
    assert _chi_square(seconds, correct) > 1e-3
    if speculation["method"] == "ngram":
        assert _chi_square(seconds, mutant) < 1e-3  # the test can tell a residual left unmasked
