"""Medusa heads: their directory, the check that they fit their target, and their training."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from specserve.medusa import HeadsMismatch, MedusaConfig, MedusaHeads, load_heads, save_heads
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
    assert train_medusa.main(["--target", str(target_dir), "--out", str(out), "--data", str(data), "--heads", "2",
                              "--tokens", "60000", "--lr", "0.01", "--seq-len", "128", "--batch", "4", "--positions", "32",
                              "--replay-prompts", "2", "--replay-prefix", "32", "--replay-tokens", "16"]) == 0  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "loss_curves.png", "model.safetensors", "training_report.json"
    ]  # fmt: skip
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
