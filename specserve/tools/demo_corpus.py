"""Documents the demo recipe derives from its corpus (specserve/tools/train_demo.py): code
that repeats its own context, and chat turns, so that the target learns to copy and to
answer a request with Python. Everything here is made from the same standard-library files
the recipe trains on; the held-out files make the probes.

- **Edit copies.** A function, then the same function again with a light edit, the way a
  refactor, a review or a retrieval prompt repeats its context: an identifier renamed
  everywhere, a literal changed, or unchanged; sometimes with a line saying what changed,
  in one of several wordings (no fixed template: the target must copy because the context
  says so, not because a marker does).
- **Chat turns.** A function's docstring (its first sentence) as the user's request and the
  function as the assistant's answer, rendered in the tokenizer's chat template.
- **The copy probe.** Held-out functions and their renamed copies: how often the target's
  argmax is the copy's next token, teacher-forced, over the copy (an induction score).
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import random
import re
import textwrap
import tokenize

import numpy as np

EOS = "<|endoftext|>"
MIN_LINES, MAX_LINES = 4, 40  # functions short enough that a copy fits the training context
SKIPPED_NAMES = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls"}
SUFFIXES = ("_value", "_new", "2", "_item", "_arg", "_obj", "_data", "_tmp", "_out", "_x")
REPLACEMENTS = ("value", "item", "result", "data", "node", "key", "name", "obj", "text", "count", "index", "entry")
EDIT_NOTES = (
    "",
    "",
    "\n# The same function, with `{old}` renamed to `{new}`:\n",
    "\n# Renamed {old} -> {new}\n",
    "\n# refactor: rename `{old}` to `{new}`\n",
    "\n# Copy of {function} with {old} called {new}.\n",
    "\n# {function}, again:\n",
)
REPEAT_RUN_TOKENS = (8, 96)  # a repeated run's length, uniform in this range
REPEAT_GAP_TOKENS = 24  # corpus tokens between a run and its copy: 0 up to this
RANDOM_RUN_SHARE = 0.5  # runs of uniformly random tokens; the rest are corpus spans
EDITED_COPY_SHARE = 0.3  # copies with one token changed
IGNORE_LABEL = -100  # a position left out of the loss (transformers' ignore index)
REQUESTS = (
    "Write a function to {doc}",
    "Write a Python function `{name}` that does this: {doc}",
    "{Doc}",
    "Implement {name}({args}): {doc}",
    "Can you write a function that will {doc}",
)


def functions(source: str, min_lines: int = MIN_LINES, max_lines: int = MAX_LINES) -> list[tuple[ast.FunctionDef, str]]:
    """Every function of min_lines..max_lines lines in source, with its dedented source."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                segment = ast.get_source_segment(source, node, padded=True)
                if segment:
                    found.append((node, textwrap.dedent(segment)))
    return found


def local_names(code: str) -> list[str]:
    """Names the function binds that a rename can change: its arguments, then the names it
    assigns, in order of first appearance."""
    names: list[str] = []
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.append(node.id)
    unique = dict.fromkeys(n for n in names if n not in SKIPPED_NAMES and len(n) > 1)
    return list(unique)


def rename(code: str, old: str, new: str) -> str | None:
    """code with every name old replaced by new (attributes, strings and comments kept), or
    None where the code does not tokenize."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    lines = code.splitlines(keepends=True)
    edits = [
        t.start
        for before, t in zip([None, *tokens], tokens)
        if t.type == tokenize.NAME and t.string == old and not (before and before.string == ".")  # not attributes
    ]
    for row, col in reversed(edits):  # right to left, so earlier columns stay valid
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "".join(lines)


def change_literal(code: str, rng: random.Random) -> str | None:
    """code with one small integer literal changed, or None where it has none."""
    spots = [m for m in re.finditer(r"(?<![\w.])([0-9])(?![\w.])", code)]
    if not spots:
        return None
    spot = rng.choice(spots)
    digit = str((int(spot.group(1)) + rng.randint(1, 8)) % 10)
    return code[: spot.start()] + digit + code[spot.end() :]


def edit_copy(node: ast.FunctionDef, code: str, rng: random.Random) -> str | None:
    """The function, then an edited copy of it (a document of its own)."""
    names = local_names(code)
    kind = rng.random()
    if names and kind < 0.7:
        old = rng.choice(names[:4])
        new = old + rng.choice(SUFFIXES) if rng.random() < 0.6 else rng.choice(REPLACEMENTS)
        if new in names or new == old:
            return None
        copy = rename(code, old, new)
        note = rng.choice(EDIT_NOTES).format(old=old, new=new, function=node.name)
    elif kind < 0.85:
        copy, note = change_literal(code, rng), rng.choice(("", "\n# With another constant:\n"))
    else:
        copy, note = code, rng.choice(("", "\n# {function}, again:\n")).format(function=node.name)
    if copy is None:
        return None
    return f"{code}\n{note or chr(10)}{copy}"


def request_for(node: ast.FunctionDef) -> tuple[str, str] | None:
    """The first sentence of the function's docstring and its arguments, for a user's request."""
    doc = ast.get_docstring(node)
    if not doc:
        return None
    sentence = re.split(r"(?<=\.)\s|\n\s*\n", doc.strip(), maxsplit=1)[0].replace("\n", " ").strip()
    if not 12 <= len(sentence) <= 200 or not sentence[0].isalpha():
        return None
    args = ", ".join(a.arg for a in node.args.args)
    return sentence, args


def chat_turn(node: ast.FunctionDef, code: str, rng: random.Random) -> str | None:
    """The docstring as the user's turn and the function as the assistant's, in the chat
    template's rendering (EOS, the roles, the turns; EOS after the answer)."""
    found = request_for(node)
    if found is None:
        return None
    sentence, args = found
    doc = sentence[0].lower() + sentence[1:]
    request = rng.choice(REQUESTS).format(doc=doc, Doc=sentence, name=node.name, args=args)
    return f"{EOS}<|user|>\n{request}\n<|assistant|>\n{code.rstrip()}\n"


def derived_documents(sources: list[str], seed: int, copies: int, chats: int) -> tuple[list[str], list[str]]:
    """Up to `copies` edit-copy documents and `chats` chat documents from sources, in a seeded
    order (a function gives at most one of each)."""
    rng = random.Random(seed)
    found = [item for source in sources for item in functions(source)]
    rng.shuffle(found)
    made_copies: list[str] = []
    made_chats: list[str] = []
    for node, code in found:
        if len(made_copies) < copies:
            document = edit_copy(node, code, rng)
            if document is not None:
                made_copies.append(document)
        if len(made_chats) < chats:
            document = chat_turn(node, code, rng)
            if document is not None:
                made_chats.append(document)
        if len(made_copies) >= copies and len(made_chats) >= chats:
            break
    return made_copies, made_chats


def copy_probe_pairs(sources: list[str], count: int, seed: int) -> list[tuple[str, str]]:
    """(context, copy): a held-out function and a rename marker, then the renamed copy the
    target should continue with, for the copy probe."""
    rng = random.Random(seed)
    pairs = []
    for _, code in (item for source in sources for item in functions(source)):
        names = local_names(code)
        if not names:
            continue
        old = names[0]
        copy = rename(code, old, old + "_new")
        if copy is not None and copy != code:
            pairs.append((f"{code}\n", copy))
    rng.shuffle(pairs)
    return pairs[:count]


def repeat_row(
    stream: np.ndarray, seq_len: int, rng: np.random.Generator, first_id: int, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """One training row of repeated runs: (tokens, labels), both [seq_len]. Runs of corpus
    tokens (`stream`) or of random ids in first_id..vocab-1, each followed by a gap of corpus
    text and then by the run again (sometimes with one token changed); a random run's first
    occurrence is IGNORE_LABEL in labels, since nothing predicts it."""
    tokens: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    filled = 0

    def span(length: int) -> np.ndarray:
        start = int(rng.integers(0, len(stream) - length))
        return stream[start : start + length].astype(np.int64)

    while filled < seq_len:
        length = int(rng.integers(REPEAT_RUN_TOKENS[0], REPEAT_RUN_TOKENS[1] + 1))
        if rng.random() < RANDOM_RUN_SHARE:
            run = rng.integers(first_id, vocab, length)
            run_labels = np.full(length, IGNORE_LABEL)
        else:
            run = run_labels = span(length)
        gap = span(int(rng.integers(0, REPEAT_GAP_TOKENS + 1)))
        copy = run.copy()
        if rng.random() < EDITED_COPY_SHARE:
            copy[int(rng.integers(0, length))] = int(rng.integers(first_id, vocab))
        tokens += [run, gap, copy]
        labels += [run_labels, gap, copy]
        filled += 2 * length + len(gap)
    return np.concatenate(tokens)[:seq_len], np.concatenate(labels)[:seq_len]
