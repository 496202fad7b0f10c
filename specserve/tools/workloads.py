"""Prompts drawn from the demo pair's held-out split (models/demo/heldout_files.txt: stdlib
files the demo models never trained on) and from installed packages, for benchmarks and the
model card; and the prompts drafters train on (chat questions, code outside the held-out
split and the third-party workload's packages)."""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from pathlib import Path

from specserve.paths import DEMO_MODELS

HELDOUT_LISTING = DEMO_MODELS / "heldout_files.txt"


def heldout_files(listing: Path = HELDOUT_LISTING) -> list[str]:
    """The held-out files' paths under the standard library, in the listing's order (none
    where there is no listing)."""
    return listing.read_text().split() if listing.is_file() else []


def heldout_sources(listing: Path = HELDOUT_LISTING) -> list[tuple[str, str]]:
    """(relative path, source) of each held-out file, in the listing's order."""
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} is missing: it comes with the demo models (specserve train-demo)")
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for rel in heldout_files(listing):
        path = root / rel
        if path.is_file():
            sources.append((rel, path.read_text(encoding="utf-8")))
    if not sources:
        raise FileNotFoundError(f"none of the files in {listing} exist under {root}")
    return sources


# Third-party packages that every install of specserve has (its dependencies): code the demo
# models never saw, in other hands' style, unlike the held-out standard-library files.
THIRD_PARTY_PACKAGES = ("httpx", "grpc", "google.protobuf", "opentelemetry.sdk", "tqdm", "pydantic", "fastapi")


def third_party_sources(min_lines: int = 120) -> list[tuple[str, str]]:
    """(path under its package, source) of the installed THIRD_PARTY_PACKAGES' Python files of
    at least min_lines lines, by package, then path."""
    import importlib.util

    sources = []
    for package in THIRD_PARTY_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.count("\n") >= min_lines and "_pb2" not in path.name:
                sources.append((f"{package}/{path.relative_to(root).as_posix()}", text))
    return sources


# The held-out third-party packages and their kin (forks, the same authors' libraries, what they
# are built on): no drafter trains on them, so that workload `thirdparty` stays unseen.
HELD_OUT_KIN = ("httpx", "httpcore", "grpc", "google", "opentelemetry", "tqdm", "pydantic", "fastapi", "starlette")


def training_code_contexts(count: int, seed: int, context_lines: int = 24) -> list[str]:
    """count code prompts for training a code target's drafters (specserve train-eagle --text
    code): each the context_lines lines before a random cut in a random Python file, one a
    file, from the installed packages other than HELD_OUT_KIN and specserve, and the standard
    library outside the demo's held-out split (models/demo/heldout_files.txt)."""
    stdlib, installed = Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])
    held = {stdlib / rel for rel in heldout_files()}
    skipped = ("site-packages", "test", "tests", "specserve", *HELD_OUT_KIN)
    paths = sorted(
        path
        for root in (stdlib, installed)
        for path in root.rglob("*.py")
        if path not in held and not any(part.startswith(skipped) for part in path.relative_to(root).parts[:-1])
    )
    rng = random.Random(seed)
    rng.shuffle(paths)
    prompts: list[str] = []
    for path in paths:
        if len(prompts) == count:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) > context_lines + 8:
            cut = rng.randrange(context_lines, len(lines) - 8)
            prompts.append(_at_token_boundary("".join(lines[cut - context_lines : cut])))
    return prompts


def code_completion_prompts(count: int, context_lines: int = 24, sources: list | None = None) -> list[str]:
    """count prompts, each the context_lines lines before a cut point inside a held-out file
    (or one of sources), cut points spread evenly over each file, at line starts, never in the
    first lines."""
    sources = heldout_sources() if sources is None else _spread(sources, count)
    per_file = max(1, -(-count // len(sources)))
    prompts: list[str] = []
    for _, text in sources:
        lines = text.splitlines(keepends=True)
        if len(lines) <= context_lines + 8:
            continue
        for i in range(per_file):
            cut = context_lines + (len(lines) - context_lines - 8) * (i + 1) // (per_file + 1)
            prompts.append(_at_token_boundary("".join(lines[cut - context_lines : cut])))
    return _spread(prompts, count)


def function_headers(count: int) -> list[str]:
    """count function headers (decorators excluded, signature through its colon), dedented,
    from the held-out files: the prompts of the model card's tokenize check."""
    headers: list[str] = []
    for _, text in heldout_sources():
        lines = text.splitlines(keepends=True)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                header = "".join(lines[node.lineno - 1 : node.body[0].lineno - 1])
                if header.rstrip().endswith(":"):
                    headers.append(_at_token_boundary(textwrap.dedent(header)))
    return _spread(headers, count)


def _functions(min_lines: int, max_lines: int) -> list[tuple[ast.FunctionDef, str]]:
    """Held-out functions (not async ones) of min_lines..max_lines lines, with their dedented source."""
    from specserve.tools.demo_corpus import functions

    return [
        (node, source)
        for _, text in heldout_sources()
        for node, source in functions(text, min_lines, max_lines)
        if isinstance(node, ast.FunctionDef)
    ]


def edit_prompts(count: int) -> list[str]:
    """Copy-heavy editing: a function, then the start of the same function with one
    identifier renamed. The continuation is mostly a copy, which drafts well."""
    prompts = []
    for node, source in _functions(8, 30):
        names = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 2]
        if not names:
            continue
        old, new = names[0], f"{names[0]}_value"
        renamed = re.sub(rf"\b{re.escape(old)}\b", new, source)
        first_line = renamed.splitlines(keepends=True)[0]
        prompts.append(
            _at_token_boundary(f"{source}\n\n# The same function, with `{old}` renamed to `{new}`:\n{first_line}")
        )
    return _spread(prompts, count)


def template_prompts(count: int, repeats: int = 3) -> list[str]:
    """An agent-like loop: the same code context sent again and again, each time under
    another first line (the step's number), as a loop re-sends its tool-call template. The
    answers repeat across requests, not within one: the first pass over the contexts is new,
    the later ones are what earlier requests were answered."""
    contexts = code_completion_prompts(-(-count // repeats), context_lines=16)
    return [f"# agent step {step + 1}\n{context}" for step in range(repeats) for context in contexts][:count]


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    """Chat requests asking for the body of a held-out function."""
    return [
        [{"role": "user", "content": f"Write the body of this Python function.\n\n{header}"}]
        for header in function_headers(count)
    ]


def _at_token_boundary(prompt: str) -> str:
    """The prompt without its final newline. A byte-level BPE merges a newline with the next
    line's indentation into one token, so a prompt that ends in a bare newline ends inside a
    token the model never saw split, and it continues badly; ending at the colon or the end
    of a statement lets it emit the newline-and-indent token itself."""
    return prompt.rstrip("\n")


def _spread(items: list[str], count: int) -> list[str]:
    """count items taken evenly across the list (all of them when there are fewer)."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


CHAT_TEMPLATES = (
    "Explain what {w} means in a few sentences.",
    "Give me three practical tips about {w}.",
    "Write a short paragraph about {w}.",
    "What is the history of {w}?",
    "How can I learn more about {w}?",
    "What are the pros and cons of {w}?",
    "Write a short email to a friend about {w}.",
    "List five facts about {w}.",
    "Why is {w} important?",
    "Describe {w} to a ten-year-old.",
    "What questions should I ask about {w}?",
    "Write a haiku about {w}.",
    "Compare {w} and {v}.",
    "How are {w} and {v} related?",
    "Tell me a short story that involves {w}.",
    "What mistakes do people make with {w}?",
)
FALLBACK_WORDS = ("gardens", "bicycles", "weather", "cooking", "music", "rivers", "history", "friendship")


def chat_questions(tokenizer, count: int, seed: int) -> list[str]:
    """count chat questions from CHAT_TEMPLATES and the tokenizer's whole lowercase words of
    5-12 letters (FALLBACK_WORDS where it has none): text a chat model answers in its own
    words, to train its drafters on (specserve train-eagle, scripts/chat_answers.py)."""
    words = sorted(
        {t[1:].lower() for t in tokenizer.get_vocab() if t[:1] in ("Ġ", "▁") and re.fullmatch(r"[a-z]{5,12}", t[1:])}
    ) or list(FALLBACK_WORDS)
    rng = random.Random(seed)
    return [rng.choice(CHAT_TEMPLATES).format(w=rng.choice(words), v=rng.choice(words)) for _ in range(count)]
