"""The source keeps its shape: scripts/layout.py's limits (runtime modules of at most 500
lines, functions of at most 60 outside kernels/, no import cycle, TYPE_CHECKING imports
counted, no `# fmt: skip` in runtime code, the tools out of the runtime package), and the
Llama forward defined once."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layout_script_finds_nothing_to_report():
    result = subprocess.run([sys.executable, "scripts/layout.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_layout_script_reports_what_it_should():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import layout
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert layout.cycles(graph) == [["a", "b", "c", "a"]]
    tree = __import__("ast").parse("def f():\n" + "    x = 1\n" * 70)
    assert layout.long_functions(tree) == [("f", 71)]
    hidden = __import__("ast").parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n")
    assert layout.module_imports(hidden, "p.a", {"p.a", "p.b"}) == {"p.b"}
    listed = __import__("ast").parse('METHODS = ("draft_model", "ngram")\nONE = ["ngram"]\n')
    assert layout.method_lists(listed) == [1]


def test_the_layers_math_is_written_once():
    """Norms, RoPE and the MLP of a decoder layer live in specserve/model/llama.py only: the
    eager forward and the compiled steps both call its functions."""
    math = re.compile(r"F\.rms_norm\(|F\.silu\(|torch\.cat\(\[-\w+\[\.\.\., half:\]")
    for path in (ROOT / "specserve").rglob("*.py"):
        if path.name != "llama.py" and "tools" not in path.parts:
            assert not math.search(path.read_text()), f"{path.relative_to(ROOT)} writes a layer's math again"
    for name in ("runner.py", "compiled_steps.py"):
        assert "decoder_layer(" in (ROOT / "specserve" / "model" / name).read_text()
