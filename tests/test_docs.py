"""Every `specserve ...` command that README.md and docs/ show a reader is one the command
takes: each is parsed by the parser of its subcommand (flags, choices and value types), so
a renamed or removed flag fails here, not in a newcomer's first hour."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from specserve.config import add_arguments

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _service_parser(module: str, config: str, prefix: str) -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, getattr(importlib.import_module(module), config), prefix)
    return parser


def parser_of(subcommand: str) -> argparse.ArgumentParser | None:
    from specserve.cli import _parser
    from specserve.model import gguf
    from specserve.tools import bench, demo_eval, fuzz, load, protogen, trace_report, train_demo, train_medusa

    tools = {"bench": bench, "load": load, "fuzz": fuzz, "trace": trace_report, "eval-demo": demo_eval,
             "train-demo": train_demo, "train-medusa": train_medusa, "gen-protos": protogen,
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
                    found.append((path.name, " ".join(words)))
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
