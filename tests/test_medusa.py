"""Medusa heads: their directory, the check that they fit their target, and their training."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import httpx
import pytest
import torch

from specserve.methods.medusa import HeadsMismatch, MedusaConfig, MedusaHeads, load_heads, save_heads
from specserve.methods.medusa_drafts import MedusaDrafting
from specserve.methods.trees import TreeShape
from specserve.model.linear import Linear
from specserve.tools.testing import save_pair


def test_heads_round_trip_and_start_as_the_target_lm_heads_guess(tiny_pair):
    target_dir, _ = tiny_pair
    heads = MedusaHeads(MedusaConfig.for_target(target_dir, 3))
    hidden = torch.randn(5, heads.config.hidden_size)
    lm_head = torch.randn(heads.config.vocab_size, heads.config.hidden_size)
    # Fresh heads are the identity: every head guesses what the LM head does.
    torch.testing.assert_close(heads.logits(hidden, lm_head), (hidden @ lm_head.T).expand(3, -1, -1))
    with torch.no_grad():
        for head in heads.heads:
            head.weight.normal_(0, 0.1)
    save_heads(heads, target_dir.parent / "heads")
    loaded = load_heads(target_dir.parent / "heads", target_dir)
    assert loaded.config == heads.config
    torch.testing.assert_close(loaded.logits(hidden, lm_head), heads.logits(hidden, lm_head), atol=0.05, rtol=0.01)


def test_heads_made_for_another_target_are_refused(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    save_heads(MedusaHeads(MedusaConfig.for_target(target_dir, 2)), tmp_path / "heads")
    narrower, _ = save_pair(tmp_path / "narrow", hidden=32)
    with pytest.raises(HeadsMismatch, match="hidden_size 64"):
        load_heads(tmp_path / "heads", narrower)
    deeper, _ = save_pair(tmp_path / "deep", layers=3)  # same width and vocabulary, another model
    with pytest.raises(HeadsMismatch, match="made for another target"):
        load_heads(tmp_path / "heads", deeper)
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    (tmp_path / "heads" / "config.json").write_text(json.dumps({**config, "format": "something-else"}))
    with pytest.raises(HeadsMismatch, match="not a Medusa heads config"):
        load_heads(tmp_path / "heads", target_dir)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_heads(tmp_path, target_dir)


def test_train_medusa_learns_the_targets_later_tokens_in_seconds(tiny_pair, tmp_path):
    """On a tiny target and a few standard-library files, the trained heads' held-out KL
    from the target's later distributions is well below the untrained ones' (the LM head's
    guess of the next token)."""
    from specserve.tools import train_medusa

    target_dir, _ = tiny_pair
    data = tmp_path / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "shlex.py", "glob.py"):
        (data / name).write_text((stdlib / name).read_text())
    out = tmp_path / "heads"
    assert (
        train_medusa.main(
            [
                "--target",
                str(target_dir),
                "--out",
                str(out),
                "--data",
                str(data),
                "--heads",
                "2",
                "--tokens",
                "60000",
                "--lr",
                "0.01",
                "--seq-len",
                "128",
                "--batch",
                "4",
                "--positions",
                "32",
                "--replay-prompts",
                "2",
                "--replay-prefix",
                "32",
                "--replay-tokens",
                "16",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "loss_curves.png",
        "model.safetensors",
        "training_report.json",
    ]
    report = json.loads((out / "training_report.json").read_text())
    target = train_medusa.recipe.load_model(target_dir)
    from transformers import AutoTokenizer

    _, heldout = train_medusa.read_texts([str(data)])
    seqs = train_medusa.recipe.to_sequences(
        train_medusa.encode(AutoTokenizer.from_pretrained(target_dir), heldout), 128
    )[:24]
    untrained_heads = MedusaHeads(MedusaConfig.for_target(target_dir, 2))
    trained_heads = load_heads(out, target_dir)
    assert train_medusa.agreement(target, trained_heads, seqs)["top1"] == pytest.approx(
        report["heldout"]["top1"], abs=0.02
    )

    def heldout_kl(heads):
        generator = torch.Generator().manual_seed(0)  # the same positions for both
        return float(train_medusa.head_losses(target, heads, torch.from_numpy(seqs), 64, generator).sum())

    assert heldout_kl(trained_heads) < 0.8 * heldout_kl(untrained_heads)
    assert report["greedy_tokens_per_round"]["top1"] >= 1.0


def test_train_medusa_refuses_bad_flags_before_loading_anything(tmp_path):
    from specserve.tools import train_medusa

    with pytest.raises(SystemExit, match="--seq-len must exceed"):
        train_medusa.main(["--seq-len", "4", "--out", str(tmp_path / "h")])
    with pytest.raises(SystemExit, match="no config.json"):
        train_medusa.main(["--target", str(tmp_path), "--out", str(tmp_path / "h")])
    assert not (tmp_path / "h").exists()


def _drafting(heads: MedusaHeads, lm_head: torch.Tensor, copy: bool = True) -> MedusaDrafting:
    """The verifier's Medusa drafting over a float32 LM head (products as F.linear's)."""
    return MedusaDrafting(heads, Linear(lm_head, row_invariant=False), ngram_max=4, copy=copy)


def test_medusa_rounds_draft_a_copy_then_the_heads_guesses_and_trees_of_their_top_tokens(tiny_pair):
    target_dir, _ = tiny_pair
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.for_target(target_dir, 3))
    with torch.no_grad():
        for head in heads.heads:
            head.weight.normal_(0, 0.2)
    lm_head = torch.randn(heads.config.vocab_size, heads.config.hidden_size)
    hidden = torch.randn(heads.config.hidden_size)
    expected = heads.logits(hidden, lm_head).topk(3, dim=-1).indices.tolist()  # [head][rank]
    guesses = [top[0] for top in expected]
    drafting = _drafting(heads, lm_head)
    unrepeated = [1, 2, 3, 4, 5]

    # A chain: the heads' top guesses; as long as K, at most one per head.
    assert drafting.propose([(unrepeated, hidden, 2, None, True)]) == [(tuple(guesses[:2]), (), ())]
    assert drafting.propose([(unrepeated, hidden, 8, None, True)])[0][0] == tuple(guesses)
    # Where the sequence's last token occurred before, a copy of what followed it comes first.
    repeated = [7, 8, 9, 10, 7]
    assert drafting.propose([(repeated, hidden, 3, None, True)])[0][0] == (8, 9, 10)
    assert drafting.propose([(repeated, hidden, 3, None, True)])[0][0] == (8, 9, 10)
    assert drafting.propose([([7, 8, 7], hidden, 3, None, True)])[0][0] == (8, 7, guesses[2])
    assert _drafting(heads, lm_head, copy=False).propose([(repeated, hidden, 2, None, True)])[0][0] == tuple(
        guesses[:2]
    )
    # Sampled: the chain, each draft's q one-hot (the candidates depend on the sequence alone).
    drafts, q, parents = drafting.propose([([7, 8, 7], hidden, 3, None, False)])[0]
    assert drafts == (8, 7, guesses[2]) and parents == ()
    assert [(d.token_ids, d.probs) for d in q] == [((8,), (1.0,)), ((7,), (1.0,)), ((guesses[2],), (1.0,))]

    # Logits processing: each head's token is the argmax of its logits processed after the
    # drafts before it (here: a draft already in the chain is masked), and a tree becomes a chain.
    def no_repeats(logits, added):
        return logits.index_fill(0, torch.tensor(added + [guesses[0]], dtype=torch.long), float("-inf"))

    ranked = [heads.logits(hidden, lm_head)[head].topk(4).indices.tolist() for head in range(3)]
    chain = [ranked[0][1]]
    for head in (1, 2):
        chain.append(next(t for t in ranked[head] if t not in chain and t != guesses[0]))
    tree = TreeShape.from_children_per_depth([2, 1])
    assert drafting.propose([(unrepeated, hidden, 3, None, True)], [no_repeats]) == [(tuple(chain), (), ())]
    assert drafting.propose([(unrepeated, hidden, 3, tree, True)], [no_repeats])[0][0] == tuple(chain[:2])
    assert drafting.propose([(repeated, hidden, 4, None, True)], [no_repeats])[0][0][:3] == (8, 9, 10)  # copies stay
    # No hidden state (the transformers backend): the copy alone.
    assert drafting.propose([(repeated, None, 3, None, True)])[0][0] == (8, 9, 10)
    assert drafting.propose([(unrepeated, None, 3, None, True)])[0][0] == ()

    # A greedy tree: rank r at depth d is the chain's token (r = 0), then head d's others.
    tree = TreeShape.parse([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    drafts, q, parents = drafting.propose([([7, 8, 7], hidden, len(tree), tree, True)])[0]
    first, second = [t for t in expected[0] if t != 8], [t for t in expected[1] if t != 7]
    assert q == () and parents == (0, 1, 1, 0, 4, 0)  # depth first: [0], [0, 0], [0, 1], [1], [1, 0], [2]
    assert drafts == (8, 7, second[0], first[0], 7, first[1])
    # A sampled request's tree is its first branch, a chain.
    drafts, q, parents = drafting.propose([([7, 8, 7], hidden, len(tree), tree, False)])[0]
    assert drafts == (8, 7) and parents == () and len(q) == 2
    # Rows of one batch are drafted together, each from its own hidden state.
    other = torch.randn(heads.config.hidden_size)
    batch = drafting.propose([(unrepeated, hidden, 3, None, True), (unrepeated, other, 3, None, True)])
    assert batch[0][0] == tuple(guesses) and batch[1][0] == tuple(
        t[0] for t in heads.logits(other, lm_head).topk(1, dim=-1).indices.tolist()
    )


def test_greedy_medusa_output_equals_target_only_chains_and_trees(request, tiny_pair):
    """Through the stack (the verifier serves the tiny target's heads), with a draft service
    beside it or not: Medusa's rounds never leave the verifier."""
    from tests.test_e2e import PROMPTS

    speculations = [
        {"method": "medusa", "num_speculative_tokens": 3, "adaptive": False},
        {"method": "medusa", "num_speculative_tokens": 4},
        {"method": "medusa", "tree": [2, 2, 1]},
        {"method": "none"},
    ]
    for stack_name in ("stack", "split_stack"):
        stack = request.getfixturevalue(stack_name)
        accepted = 0
        for prompt in PROMPTS:
            outputs = []
            for speculation in speculations:
                body = complete(stack.url, prompt, speculation)
                outputs.append(body["choices"][0]["token_ids"])
                accepted += body["usage"].get("speculation", {}).get("num_accepted_tokens", 0)
            assert all(output == outputs[-1] for output in outputs), (stack_name, prompt)
        assert accepted > 0, stack_name  # the heads' guesses and the copies were kept at times


def complete(url: str, prompt, speculation: dict) -> dict:
    from tests.test_e2e import complete as post

    return post(url, prompt=list(prompt), max_tokens=32, temperature=0, return_token_ids=True, speculation=speculation)


def test_sampled_medusa_rounds_follow_the_target_distribution(stack):
    """1000 seeded requests at temperature 1: the second token, decided by the round drafted
    after the prefill, follows the target exactly. The prompt makes that round's drafts start
    with a copy the target often keeps (one-hot q), the heads' guesses after it, so drafts
    of both kinds are kept and rejected."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_e2e import PROMPTS, _chi_square, _copy_firing_prompt, _target_first_two_token_distributions

    prompt, _ = _copy_firing_prompt(stack.target_dir, PROMPTS[0])

    def run(seed):
        body = httpx.post(
            f"{stack.url}/v1/completions",
            timeout=120,
            json={
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 1.0,
                "seed": seed,
                "return_token_ids": True,
                "speculation": {"method": "medusa", "num_speculative_tokens": 3, "adaptive": False},
            },
        ).json()
        return body["choices"][0]["token_ids"], body["usage"]["speculation"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(1000)))
    drafted = sum(usage["num_draft_tokens"] for _, usage in results)
    accepted = sum(usage["num_accepted_tokens"] for _, usage in results)
    assert 0.03 * drafted < accepted < 0.95 * drafted  # drafts both kept and rejected: the rule is exercised
    first, second = _target_first_two_token_distributions(stack.target_dir, prompt)
    assert _chi_square([tokens[1] for tokens, _ in results], second) > 1e-3
    assert _chi_square([tokens[1] for tokens, _ in results], first) < 1e-3  # the test can tell them apart


def test_a_verifier_refuses_to_start_with_heads_made_for_another_target(tiny_pair, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import free_port

    target_dir, _ = tiny_pair
    other, _ = save_pair(tmp_path / "other", layers=3)
    save_heads(MedusaHeads(MedusaConfig.for_target(other, 2)), tmp_path / "heads")
    env = {**os.environ, "SPECSERVE_VERIFY_COMPILE_STEPS": "0", "SPECSERVE_VERIFY_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "verify_service",
        "--model",
        str(target_dir),
        "--medusa",
        str(tmp_path / "heads"),
        "--port",
        str(free_port()),
        "--metrics-port",
        "0",
        "--health-port",
        str(free_port()),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "refusing to start: the heads were made for another target" in result.stderr
