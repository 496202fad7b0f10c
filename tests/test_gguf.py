"""GGUF files and named models: a tiny Llama GGUF written here (Q4_1 layers, a Q8_0 embedding,
as llama.cpp's converter lays them out) is converted into a model directory, which the runner
serves with the file's own bits (4-bit layers, an 8-bit output), and a named model is
converted once into the cache. A stack serves it without a draft model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

from specserve.model import gguf as named
from specserve.model.gguf import MARKER, ModelNotFound, convert_gguf, resolve_model, source_bits
from specserve.tools.testing import save_tiny_gguf
from tests.conftest import start_stack, stop_process


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    return convert_gguf(save_tiny_gguf(folder / "tiny.Q4_1.gguf"), folder / "tiny")


def test_a_converted_gguf_is_served_with_the_bits_the_file_held(converted):
    from transformers import AutoModelForCausalLM

    from specserve.model.runner import LlamaRunner

    assert source_bits(converted) == (4, 8)
    assert json.loads((converted / MARKER).read_text())["source_types"] == {"layers": "Q4_1", "output": "Q8_0"}
    runner = LlamaRunner(str(converted), torch.device("cpu"), torch.float32, 2, 256)
    assert runner.int4 and runner.layers[0].qkv.int4 is not None and runner.lm_head.quantized is not None
    reference = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    tokens = [256, 10, 20, 30, 40, 50, 60, 70]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    slot = runner.allocate()
    (logits,) = runner.forward([slot], [0], [tokens], [len(tokens)])
    # The file's own rounding, not the model's: the runner's 4-bit groups hold the same levels.
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


def test_asking_int4_keeps_every_matrix_in_4_bits_and_products_stay_row_independent(converted):
    from specserve.model.linear import row_independent
    from specserve.model.runner import LlamaRunner

    runner = LlamaRunner(str(converted), torch.device("cpu"), torch.float32, 2, 256, matmul_dtype="int4")
    layer = runner.layers[0]
    assert all(m.int4 is not None for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert runner.lm_head.int4 is None  # 259 outputs: not the 4-bit kernel's blocks of 16, kept in 16 bits
    assert all(row_independent(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down, runner.lm_head))


def test_a_named_model_is_converted_once_into_the_cache(converted, tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_named_model"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the package itself is never imported')\n")
    save_tiny_gguf(package / "model.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = named.NamedModel("fake_named_model", "model.gguf", "fake", "a test model")
    monkeypatch.setitem(named.NAMED_MODELS, "fake", model)
    monkeypatch.setenv(named.CACHE_ENV, str(tmp_path / "cache"))
    directory = Path(resolve_model("fake"))
    assert directory == tmp_path / "cache" / "models" / "fake" and (directory / "config.json").is_file()
    made = (directory / MARKER).stat().st_mtime_ns
    assert resolve_model("fake") == str(directory) and (directory / MARKER).stat().st_mtime_ns == made
    assert resolve_model(str(converted)) == str(converted)  # a directory is itself


def test_a_named_model_without_its_package_names_the_extra(monkeypatch, capsys):
    from specserve import cli, up

    monkeypatch.setitem(named.NAMED_MODELS, "absent", named.NamedModel("no_such_package_x", "m.gguf", "absent", ""))
    with pytest.raises(ModelNotFound, match=r'pip install -e "\.\[absent\]"'):
        resolve_model("absent")
    assert "no-such-package-x, which is not installed" in up.resolve_models(
        cli._parser().parse_args(["up", "--target", "absent"])
    )
    ports = ["--port", "0", "--verify-port", "0", "--verify-metrics-port", "0"]
    assert up.up(cli._parser().parse_args(["up", "--target", "absent", *ports])) == 2
    assert 'pip install -e ".[absent]"' in capsys.readouterr().err


def test_convert_gguf_refuses_a_missing_file(tmp_path, capsys):
    assert named.main([str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    assert "no GGUF file" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_up_serves_a_target_without_a_draft_model(converted, tmp_path):
    """--draft none: the methods that need no draft model are served and exact; asking for the
    draft model is a 400 that names what is served; a request naming no method speculates."""
    stack = start_stack(converted, Path("none"), log_path=tmp_path / "stack.log")
    try:
        url = f"{stack.url}/v1/completions"
        body = {"prompt": "tell me", "max_tokens": 24, "temperature": 0, "return_token_ids": True}
        refused = httpx.post(url, json={**body, "speculation": {"method": "draft_model"}}, timeout=60)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "not served here" in message and "ngram" in message and "draft_model" not in message.split(";")[1]
        outputs = {}
        for method in ("none", "ngram", "suffix", "lookahead", "early_exit", None):
            speculation = {} if method is None else {"speculation": {"method": method}}
            reply = httpx.post(url, json={**body, **speculation, "return_timings": True}, timeout=120)
            assert reply.status_code == 200, (method, reply.text)
            outputs[method] = reply.json()["choices"][0]["token_ids"]
        assert all(tokens == outputs["none"] for tokens in outputs.values()), outputs
    finally:
        stop_process(stack.process)
    assert sys.executable  # the stack ran under this interpreter
