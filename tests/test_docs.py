"""Every `specserve ...` command that README.md, CONTRIBUTING.md and docs/ (every page, the
benchmarks' history too) show a reader is one the command takes: each is parsed by the parser
of its subcommand (flags, choices and value types), so a renamed or removed flag fails here,
not in a newcomer's first hour. README.md stays short and keeps the set-up commands that
.ci/run reads, and every relative link in the docs points at a file that exists."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from specserve.config import add_arguments

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 150


def _service_parser(module: str, config: str, prefix: str) -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, getattr(importlib.import_module(module), config), prefix)
    return parser


def parser_of(subcommand: str) -> argparse.ArgumentParser | None:
    from specserve.cli import _parser
    from specserve.model import gguf
    from specserve.tools import (
        bench,
        demo_eval,
        fuzz,
        load,
        protogen,
        trace_report,
        train_demo,
        train_eagle,
        train_medusa,
    )

    tools = {"bench": bench, "load": load, "fuzz": fuzz, "trace": trace_report, "eval-demo": demo_eval,
             "train-demo": train_demo, "train-medusa": train_medusa, "train-eagle": train_eagle, "gen-protos": protogen,
             "convert-gguf": gguf}  # fmt: skip
    if subcommand in tools:
        return tools[subcommand].build_parser()
    services = {"verify": ("verify_service.config", "VerifyConfig", "verify"),
                "draft": ("draft_service.config", "DraftConfig", "draft"),
                "gateway": ("gateway.config", "GatewayConfig", "gateway")}  # fmt: skip
    if subcommand in services:
        return _service_parser(*services[subcommand])
    if subcommand == "up":
        return _parser()._subparsers._group_actions[0].choices["up"]
    return None


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every `specserve SUBCOMMAND ...` in a fenced code block (any
    language), an indented one, or inline code; environment assignments before it dropped."""
    found = []
    for path in DOCS:
        text = path.read_text()
        code, fenced = [], False
        for line in text.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced or line.startswith("    "):
                code.append(line)
        code += [" ".join(c.split()) for c in re.findall(r"`((?:[A-Z_][A-Z0-9_]*=\S+\s+)*specserve [^`]+)`", text)]
        for line in code:
            for part in re.split(r"&&|;|\|", line.split(" #")[0]):
                words = part.strip().rstrip("&").split()
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words.pop(0)
                if len(words) > 1 and words[0] == "specserve":
                    found.append((str(path.relative_to(ROOT)), " ".join(words)))
    return sorted(set(found))


# Placeholders the docs write for a value of the reader's own: a valid value of any type.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_:0-9]*$|^HOST:\d+$")


@pytest.mark.parametrize("where, command", documented_commands())
def test_a_documented_command_is_one_the_command_takes(where, command):
    words = shlex.split(command)[1:]
    if not words or words[0] in ("--help", "-h"):
        return
    parser = parser_of(words[0])
    assert parser is not None, f"{where}: `{command}`: no subcommand {words[0]}"
    arguments = ["1" if PLACEHOLDER.match(w) else w for w in words[1:]]
    try:
        parser.parse_args(arguments)
    except SystemExit as error:
        assert error.code == 0, f"{where}: `{command}` is refused"  # 0: --help
    except argparse.ArgumentError as error:
        raise AssertionError(f"{where}: `{command}` is refused: {error}") from None


def test_the_docs_show_commands_of_every_kind():
    kinds = {shlex.split(command)[1] for _, command in documented_commands() if len(shlex.split(command)) > 1}
    assert {"up", "bench", "load", "fuzz", "verify", "draft", "gateway"} <= kinds, kinds


def test_the_docs_include_contributing_and_the_benchmarks_history():
    names = {str(path.relative_to(ROOT)) for path in DOCS}
    assert {"README.md", "CONTRIBUTING.md", "docs/benchmarks.md", "docs/benchmarks/history/README.md"} <= names


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("marker, expected", [("up-command", "specserve up"), ("test-command", "python -m pytest")])
def test_the_readme_keeps_its_set_up_commands_after_their_markers(marker, expected):
    """.ci/run runs the line after <!-- test-command --> as CI's test command."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert f"<!-- {marker} -->" in lines, f"README.md lost its <!-- {marker} --> marker"
    command = lines[lines.index(f"<!-- {marker} -->") + 1]
    assert command.startswith("    ") and expected in command, command


def relative_links(path: Path) -> list[str]:
    """The targets of the page's markdown links and images, outside code, that name no scheme."""
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [target.split()[0].strip("<>") for target in re.findall(r"\]\(([^)]+)\)", text)]
    return [target for target in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(path):
    missing = [target for target in relative_links(path) if not (path.parent / target.split("#")[0]).resolve().exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to nothing: {missing}"


def test_the_link_check_sees_links():
    assert "docs/operations.md" in relative_links(ROOT / "README.md")
