"""The shipped demo pair loads as plain Hugging Face directories, and its recipe runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.model.loading import tokenizer_fingerprint
from specserve.paths import DEMO_DRAFT, DEMO_MODELS, DEMO_TARGET


def test_demo_pair_loads_as_it_is_and_shares_a_tokenizer():
    tokenizers = [AutoTokenizer.from_pretrained(d) for d in (DEMO_TARGET, DEMO_DRAFT)]
    assert tokenizer_fingerprint(tokenizers[0]) == tokenizer_fingerprint(tokenizers[1])
    source = "def f(x):\n    return {'a': x}  # é\n\n\tpass\n"
    ids = tokenizers[0](source, add_special_tokens=False)["input_ids"]
    assert tokenizers[0].decode(ids) == source  # code round-trips byte for byte
    for tokenizer in tokenizers:  # a completion prompt starts a document, as in training
        assert tokenizer(source)["input_ids"] == [tokenizer.bos_token_id, *ids]
    chat = tokenizers[0].apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n")
    sizes = (DEMO_MODELS / "medusa" / "model.safetensors").stat().st_size
    for directory in (DEMO_TARGET, DEMO_DRAFT):
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert model.config.model_type == "llama" and model.dtype == torch.float16
        sizes += (directory / "model.safetensors").stat().st_size
    assert sizes <= 40 * 1024 * 1024
    assert (DEMO_MODELS / "heldout_files.txt").read_text().split()


def test_the_demo_medusa_heads_fit_the_demo_target_and_no_other():
    from specserve.methods.medusa import HeadsMismatch, load_heads

    heads = load_heads(DEMO_MODELS / "medusa", DEMO_TARGET)
    assert heads.config.num_heads >= 2
    with pytest.raises(HeadsMismatch):
        load_heads(DEMO_MODELS / "medusa", DEMO_DRAFT)


def test_the_training_recipe_runs_end_to_end_in_smoke_mode(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.tools.train_demo",
            "--smoke",
            "--run-dir",
            str(tmp_path / "run"),
            "--out-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("target", "draft"):
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / name) is not None


def test_the_attention_guide_sees_the_attention_the_model_computes():
    from transformers import LlamaConfig, LlamaForCausalLM

    from specserve.tools.train_demo import GUIDED_HEADS, AttentionGuide

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    guide = AttentionGuide(model)
    x = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 9, 5]])  # [1, seq]: repeats give the induction head targets
    attentions = model(input_ids=x, output_attentions=True).attentions  # per layer [1, heads, seq, seq]
    for layer, head in GUIDED_HEADS:
        torch.testing.assert_close(guide.log_attention(layer, head).exp(), attentions[layer][:, head])
    # Trained on the guide's loss alone, the two heads take the circuit's patterns on runs
    # they never saw: the previous position, and the position after the earlier occurrence.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(60):
        run = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=torch.cat([run, run], dim=1))
        guide.loss(torch.cat([run, run], dim=1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    run = torch.randperm(64, generator=torch.Generator().manual_seed(999))[:12][None]  # [1, 12], no repeats
    with torch.no_grad():
        model(input_ids=torch.cat([run, run], dim=1))
        previous = guide.log_attention(*GUIDED_HEADS[0]).exp()[0]  # [seq, seq]
        induction = guide.log_attention(*GUIDED_HEADS[1]).exp()[0]  # [seq, seq]
    assert previous.diagonal(offset=-1).mean() > 0.9
    assert torch.stack([induction[12 + i, 1 + i] for i in range(11)]).mean() > 0.5
    guide.remove()
    guide.inputs.clear()
    model(input_ids=x)
    assert not guide.inputs  # no hook runs after remove()


def test_the_recipe_refuses_a_guide_on_a_model_too_shallow_for_it():
    from specserve.tools.train_demo import ModelShape, TrainDemoConfig

    with pytest.raises(ValueError, match="the draft has 1"):
        TrainDemoConfig(draft_shape=ModelShape(1, 128, 2, 384), draft_guide_weight=1.0)
    assert TrainDemoConfig(draft_shape=ModelShape(1, 128, 2, 384)).draft_shape.layers == 1  # unguided by default


def test_the_header_check_tells_a_cut_docstring_from_broken_python():
    from specserve.tools.demo_eval import tokenize_check

    assert tokenize_check("def f(x):\n    return x + 1\n") == "ok"
    assert tokenize_check('def f(x):\n    """Return x,\n    and more') == "cut"  # the budget ends the docstring
    assert tokenize_check("def f(x,\n      y") == "cut"
    assert tokenize_check("def f(x):\n        a = 1\n    b = 2\n") == "error"  # a dedent to no level
