"""EAGLE heads (specserve/methods/eagle.py): training on a tiny target's own answers, the
verifier's drafting from a session's kept hidden states, and exactness through the stack."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from specserve.methods.eagle import EagleConfig, EagleHead, attend, load_head, save_head
from specserve.methods.eagle_drafts import EagleDrafting, EagleState
from specserve.methods.medusa import HeadsMismatch
from specserve.sampling import SamplingParams, truncate_to_support
from specserve.tools import train_eagle
from tests.conftest import start_stack, stop_process
from tests.test_e2e import PROMPTS, check_second_tokens

TRAIN_FLAGS = ["--questions", "48", "--max-new-tokens", "32", "--batch", "48", "--max-steps", "80"]
TRAIN_FLAGS += ["--vocab", "512", "--heldout", "4", "--lr", "0.005", "--temperature", "1", "--text", "chat"]


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory):
    """A head trained for seconds on the tiny target's answers, and its report."""
    target_dir, _ = tiny_pair
    out = tmp_path_factory.mktemp("eagle") / "head"
    assert train_eagle.main(["--target", str(target_dir), "--out", str(out), *TRAIN_FLAGS]) == 0
    return out, json.loads((out / "training_report.json").read_text())


@pytest.fixture(scope="module")
def eagle_stack(tiny_pair, trained):
    running = start_stack(*tiny_pair, extra_args=["--eagle", str(trained[0])])
    yield running
    stop_process(running.process)


def test_train_eagle_keeps_more_drafts_than_an_untrained_head(tiny_pair, trained):
    """The trained head's held-out chains keep more drafts than the same head untrained."""
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_pair
    out, report = trained
    assert {"config.json", "model.safetensors", "training_report.json"} <= {p.name for p in out.iterdir()}
    head = load_head(out, target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()  # as the command reads
    rows = [json.loads(line) for line in (out / "work" / "answers.jsonl").read_text().splitlines()]
    rows = [row for row in rows if len(row["answer"]) > 2]  # the answers the command kept
    held = train_eagle.features(model, rows[:: train_eagle.HELD_OUT][:4])
    embed = model.get_input_embeddings().weight.detach().float()
    untrained = EagleHead(head.config)
    untrained.vocabulary.copy_(head.vocabulary)
    untrained.lm_rows.copy_(head.lm_rows)
    kept = train_eagle.replay(head, held, embed, 4).float().mean()
    assert kept == pytest.approx(report["tokens_per_round"]["K=4"] - 1, abs=0.05)
    assert kept > 1.5 * train_eagle.replay(untrained.eval(), held, embed, 4).float().mean()


def test_sampled_kept_is_the_exact_rules_chance_of_keeping_a_first_draft(tiny_pair, trained):
    """The report's sampled acceptance: at each position, the sum over tokens of min(p, q), with
    p the target's distribution of the token the head guesses (read here from the model's own
    logits, not from its hidden states) and q the head's, at one temperature."""
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_pair
    out, report = trained
    head = load_head(out, target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    row = next(
        r for r in map(json.loads, (out / "work" / "answers.jsonl").read_text().splitlines()) if len(r["answer"]) > 4
    )
    ((ids, hidden),) = train_eagle.features(model, [row])
    embed = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        logits = model(torch.tensor([row["prompt"] + row["answer"]])).logits[0].float()
        guessed, _ = head(hidden[None, :-1], embed[ids[1:]][None])  # entry t guesses token t + 2
    first, size, temperature = len(row["prompt"]) - 1, len(ids) - 1, 0.8
    drafted = (guessed[0, : size - 1] @ head.lm_rows.T / temperature).softmax(-1)
    target = (logits[first + 1 : first + size] / temperature).softmax(-1)[:, head.vocabulary]
    expected = float(torch.minimum(drafted, target).sum(-1).mean())
    assert train_eagle.sampled_kept(head, [(ids, hidden)], embed, lm_head, temperature) == pytest.approx(
        expected, abs=0.02
    )
    assert 0 < report["sampled_first_draft_kept"]["0.8"] <= 1


def test_drafting_from_kept_hidden_states_is_the_heads_own_chain(tiny_pair, trained):
    """A session's entries read round by round, as the verifier gives hidden states, draft
    what the head drafts over the whole sequence at once; skipped positions start again."""
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_pair
    head = load_head(trained[0], target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokens = list(PROMPTS[0]) + [7, 8, 9, 10, 11, 12]
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens])).last_hidden_state[0]
    embed = model.get_input_embeddings().weight.detach()
    drafting = EagleDrafting(head, embed, support_size=8, dtype=torch.float32)
    greedy, start = SamplingParams(temperature=0.0), len(PROMPTS[0]) - 1
    state = EagleState()
    state.observe(start, hidden[start : start + 1])
    ends = [len(PROMPTS[0]) + 1, len(PROMPTS[0]) + 3, len(tokens)]  # rounds that keep 1, then 2 drafts
    for end, after in zip(ends, [*ends[1:], None]):
        ((drafts, q),) = drafting.propose([(state, tokens[:end], 1, greedy)])
        assert q == ()
        with torch.no_grad():  # the head over the whole sequence since the prompt's last token
            x, qs, k, v = head.entries(
                hidden[None, start : end - 1], embed[tokens[start + 1 : end]][None], torch.arange(start, end - 1)
            )
            guess = head.finish(x, attend(qs, k, v, causal=True))[0, -1]
        assert drafts == (int(head.vocabulary[(guess @ head.lm_rows.T).argmax()]),)
        if after is not None:  # the verify's hidden states of the positions it kept
            state.observe(end - 1, hidden[end - 1 : after - 1])
    state.observe(3, hidden[3:4])  # a position that does not follow: the entries start again
    assert (state.start, state.entries, len(state.pending)) == (3, 0, 1)
    assert drafting.propose([(state, tokens, 2, greedy)]) == [((), ())]  # they do not reach the last token


def test_a_chains_later_drafts_attend_over_every_entry_before_them(tiny_pair, trained):
    """Each draft of a sampled chain is drawn from the head's guess with every entry before it
    in view (the session's and the round's own: attention written out here by hand), and
    its q is that distribution, truncated to the support size."""
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_pair
    head = load_head(trained[0], target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokens = list(PROMPTS[1]) + [7, 8, 9]
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens])).last_hidden_state[0]
    embed = model.get_input_embeddings().weight.detach()
    start = len(PROMPTS[1]) - 1
    state = EagleState()
    state.observe(start, hidden[start : len(tokens) - 1])
    drafting = EagleDrafting(head, embed, support_size=8, dtype=torch.float32)
    ((drafts, distributions),) = drafting.propose([(state, tokens, 3, SamplingParams(temperature=1.0, seed=3))])
    c = head.config
    keys, values = [], []

    def entry(feature, token, position):
        """The head's guess after one more entry, attending over all entries so far."""
        x, q, k, v = head.entries(feature[None], embed[token][None], torch.tensor([position]))
        keys.append(k[0].repeat_interleave(c.num_heads // c.num_kv_heads, 0))
        values.append(v[0].repeat_interleave(c.num_heads // c.num_kv_heads, 0))
        weights = (torch.einsum("hd,nhd->hn", q[0], torch.stack(keys)) / c.head_dim**0.5).softmax(-1)
        return head.finish(x, torch.einsum("hn,nhd->hd", weights, torch.stack(values))[None])[0]

    with torch.no_grad():
        for position in range(start, len(tokens) - 1):
            guess = entry(hidden[position], tokens[position + 1], position)
        for i, (draft, q) in enumerate(zip(drafts, distributions)):  # each draft's q: what it was drawn from
            logits = torch.full((c.vocab_size,), float("-inf"))
            logits[head.vocabulary] = guess @ head.lm_rows.T
            ids, probs = truncate_to_support(logits.softmax(-1), 8)
            assert q.token_ids == tuple(ids.tolist()) and draft in q.token_ids
            assert q.probs == pytest.approx(probs.tolist(), abs=1e-4)
            guess = entry(guess, draft, len(tokens) - 1 + i)
    assert len(drafts) == len(distributions) == 3


def test_a_head_made_for_another_target_is_refused(tiny_pair, tmp_path):
    target_dir, draft_dir = tiny_pair
    head = EagleHead(EagleConfig.for_target(draft_dir, 16))
    save_head(head, tmp_path / "head")
    with pytest.raises(HeadsMismatch, match="another target"):
        load_head(tmp_path / "head", target_dir)
    (tmp_path / "head" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_head(tmp_path / "head", draft_dir)


def complete(url: str, prompt, speculation: dict, **body) -> dict:
    reply = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"prompt": list(prompt), "return_token_ids": True, "speculation": speculation, **body},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_eagle_output_equals_target_only(eagle_stack):
    speculations = [
        {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False},
        {"method": "eagle", "num_speculative_tokens": 4},
        {"method": "none"},
    ]
    accepted = 0
    for prompt in PROMPTS:
        outputs = []
        for speculation in speculations:
            body = complete(eagle_stack.url, prompt, speculation, max_tokens=32, temperature=0)
            outputs.append(body["choices"][0]["token_ids"])
            accepted += body["usage"].get("speculation", {}).get("num_accepted_tokens", 0)
        assert all(output == outputs[-1] for output in outputs), prompt
    assert accepted > 0  # the head's guesses were kept at times


def test_sampled_eagle_rounds_follow_the_target_distribution(eagle_stack):
    """1000 seeded requests at temperature 1: the second token, decided by the round the
    head drafts after the prefill, follows the target exactly."""
    prompt = list(PROMPTS[1])
    speculation = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False}

    def run(seed):
        body = complete(eagle_stack.url, prompt, speculation, max_tokens=4, temperature=1.0, seed=seed)
        return body["choices"][0]["token_ids"], body["usage"]["speculation"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(1000)))
    check_second_tokens(eagle_stack.target_dir, prompt, results)


def test_a_stack_without_a_head_names_the_methods_it_serves(stack):
    reply = httpx.post(
        f"{stack.url}/v1/completions",
        timeout=60,
        json={"prompt": [1, 2, 3], "max_tokens": 4, "speculation": {"method": "eagle"}},
    )
    assert reply.status_code == 400
    assert "eagle" in reply.text and "ngram" in reply.text


def test_training_code_contexts_leave_the_held_out_code_out():
    """Code prompts for a code target's drafters come from installed files, one a file, the
    same for a seed, and never from the bench's held-out code (the demo's held-out standard
    library files, the third-party packages of workload thirdparty)."""
    from specserve.tools import workloads

    contexts = workloads.training_code_contexts(40, seed=3)
    assert len(contexts) == 40 and len(set(contexts)) == 40
    assert contexts == workloads.training_code_contexts(40, seed=3) != workloads.training_code_contexts(40, seed=4)
    held = [text for _, text in workloads.heldout_sources() + workloads.third_party_sources(min_lines=0)]
    assert not [c for c in contexts if any(c in text for text in held)]


def test_train_eagle_on_code_continues_installed_code(tiny_pair, tmp_path):
    """--text code: the target continues training_code_contexts, tokenized as they are."""
    from transformers import AutoTokenizer

    from specserve.tools import workloads

    target_dir, _ = tiny_pair
    out = tmp_path / "head"
    flags = ["--questions", "6", "--max-new-tokens", "8", "--batch", "6", "--max-steps", "3", "--vocab", "64"]
    assert train_eagle.main(["--target", str(target_dir), "--out", str(out), "--text", "code", *flags]) == 0
    rows = [json.loads(line) for line in (out / "work" / "answers.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert [row["prompt"] for row in rows] == [
        tokenizer(text)["input_ids"] for text in workloads.training_code_contexts(6, seed=0)
    ]
    assert (out / "model.safetensors").is_file()


def test_train_eagle_refuses_bad_flags_before_loading_anything(tmp_path):
    for flags in (["--vocab", "0"], ["--questions", "0"], ["--lr", "0"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit) as stopped:
            train_eagle.main(["--target", str(tmp_path / "absent"), "--out", str(tmp_path / "head"), *flags])
        assert stopped.value.code == 2, flags
    assert not (tmp_path / "head").exists()
