"""The methods' registry: names are written once and read everywhere, and a method is added
by one module that registers it (docs/design.md, "Methods and adding one"): here a toy one,
registered in-process and, through SPECSERVE_METHOD_MODULES, in every service of a stack."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specserve.drafting import Drafter, DraftJob, DraftOptions
from specserve.methods import registry
from specserve.methods.trees import TreeShape
from specserve.sampling import SamplingParams
from tests.conftest import start_stack, stop_process

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import layout  # scripts/layout.py: its check of method-name lists
finally:
    sys.path.remove(str(ROOT / "scripts"))

# The whole of a method that drafts from the context: one module and its register() call.
TOY_MODULE = '''
from specserve.methods import registry


class RepeatLast:
    """Drafts the sequence's last token, k times."""

    def open(self, tenant, isolated):
        return None

    def drafts(self, state, verified, start, k):
        return [verified[-1]] * k

    def finish(self, state, tokens):
        pass


registry.register(registry.MethodSpec(
    "repeat_last", "the last token, k times", registry.BOTH, context=lambda options: RepeatLast()
))
'''


@pytest.fixture
def toy(tmp_path):
    """The toy module registered in this process (and unregistered after)."""
    (tmp_path / "toy_methods.py").write_text(TOY_MODULE)
    spec = importlib.util.spec_from_file_location("toy_methods", tmp_path / "toy_methods.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    yield tmp_path
    registry.unregister("repeat_last")


def test_every_runtime_module_reads_the_method_names_from_the_registry():
    for package in ("specserve", "gateway", "verify_service", "draft_service"):
        for path in (ROOT / package).rglob("*.py"):
            if "tools" in path.parts or "v1" in path.parts:
                continue
            assert not layout.method_lists(ast.parse(path.read_text())), path.relative_to(ROOT)
    assert registry.names()[:4] == ("draft_model", "early_exit", "ngram", "suffix")
    assert set(registry.names(registry.VERIFIER)) - set(registry.names(registry.DRAFT_SERVICE)) == {
        "medusa",
        "eagle",
        "lookahead",
    }


def test_a_name_is_registered_once_and_an_unknown_one_is_refused_by_name():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.MethodSpec("ngram", "again", registry.BOTH))
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.MethodSpec("none", "target-only", registry.BOTH))
    with pytest.raises(Exception, match="must be one of draft_model, early_exit, ngram"):
        registry.spec_of("hydra")


def test_a_registered_toy_method_is_drafted_checked_and_offered_everywhere(toy):
    from gateway.api import Speculation as RequestSpeculation
    from specserve.cli import _parser
    from specserve.speculation import Speculation

    drafter = Drafter({}, DraftOptions(vocab_size=300, max_context_length=64, max_sessions=2))
    assert "repeat_last" in drafter.methods
    session = drafter.open_session("s", "repeat_last")
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1, seed=3)
    [proposal] = drafter.step([DraftJob(session, (5, 6, 7), 3, 4, greedy)])
    assert proposal.draft_token_ids == (7, 7, 7, 7) and proposal.draft_distributions == ()
    [proposal] = drafter.step([DraftJob(session, (9,), 4, 2, sampled)])
    assert proposal.draft_token_ids == (9, 9)
    assert [(d.token_ids, d.probs) for d in proposal.draft_distributions] == [((9,), (1.0,))] * 2
    drafter.close_session(session)

    class Unruly:  # more drafts than asked, then one past the vocabulary
        def open(self, tenant, isolated):
            return None

        def drafts(self, state, verified, start, k):
            return [4, 5, 299, 300, 6, 7, 8, 9][: k + 4]

        def finish(self, state, tokens):
            pass

    drafter.proposers["repeat_last"] = Unruly()
    session = drafter.open_session("u", "repeat_last")
    [proposal] = drafter.step([DraftJob(session, (5, 6, 7), 3, 3, greedy)])
    assert proposal.draft_token_ids == (4, 5, 299)
    [proposal] = drafter.step([DraftJob(session, (1,), 4, 5, greedy)])
    assert proposal.draft_token_ids == (4, 5, 299)  # cut before 300, which is no token of 300

    assert Speculation(method="repeat_last").method == "repeat_last"
    with pytest.raises(Exception, match="drafts chains"):
        Speculation(method="repeat_last", tree=TreeShape.parse([2]))
    assert RequestSpeculation(method="repeat_last").method == "repeat_last"
    up = _parser()._subparsers._group_actions[0].choices["up"]
    assert "repeat_last" in next(a for a in up._actions if a.dest == "method").choices


def test_a_method_module_that_does_not_import_is_an_error_that_names_it():
    env = {**os.environ, "SPECSERVE_METHOD_MODULES": "toy_methods_nowhere"}
    result = subprocess.run(
        [sys.executable, "-c", "import specserve.methods.registry"], env=env, capture_output=True, text=True
    )
    assert result.returncode != 0 and "SPECSERVE_METHOD_MODULES names 'toy_methods_nowhere'" in result.stderr


def test_a_method_module_named_in_the_environment_is_served_by_the_stack(tiny_pair, toy):
    env = {
        "SPECSERVE_METHOD_MODULES": "toy_methods",
        "PYTHONPATH": os.pathsep.join([str(toy), *sys.path]),
    }
    stack = start_stack(*tiny_pair, env=env)
    try:
        texts = {}
        for method in ("none", "repeat_last"):
            body = {"prompt": "aaaa aaaa aaaa", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            body["speculation"] = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
            reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()
            texts[method] = reply["choices"][0]["text"]
            if method == "repeat_last":
                assert reply["usage"]["speculation"]["num_drafts"] >= 1
        assert texts["repeat_last"] == texts["none"]  # exact: greedy output is the target's
        body = {"prompt": "x", "max_tokens": 2, "speculation": {"method": "eagle"}}
        refused = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and "repeat_last" in refused.text
    finally:
        stop_process(stack.process)
