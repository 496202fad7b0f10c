"""The shipped demo pair loads as plain Hugging Face directories, and its recipe runs."""

from __future__ import annotations

import subprocess
import sys

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
    chat = tokenizers[0].apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n")
    sizes = 0
    for directory in (DEMO_TARGET, DEMO_DRAFT):
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert model.config.model_type == "llama" and model.dtype == torch.float16
        sizes += (directory / "model.safetensors").stat().st_size
    assert sizes <= 40 * 1024 * 1024
    assert (DEMO_MODELS / "heldout_files.txt").read_text().split()


def test_the_training_recipe_runs_end_to_end_in_smoke_mode(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specserve.tools.train_demo", "--smoke", "--run-dir", str(tmp_path / "run"),
                             "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("target", "draft"):
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / name) is not None
