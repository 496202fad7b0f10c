"""Structured outputs: a request's grammar (a JSON schema, a regex, a list of choices or a
Lark grammar), compiled by llguidance against the target's tokenizer, and the state of one
session's output in it (docs/design.md, "Structured outputs").

The verifier masks the target's logits at every position of a round with the grammar's
state after the tokens before that position (a chain's drafts, a tree node's path): the
target's processed distribution is the grammar-masked one, so speculative output follows
it exactly as target-only output does. Drafts are legal or rejected: a state advances over
a copy of the drafts and rolls back, and a draft the grammar forbids ends the round's
forward. Where the grammar forces the next tokens (a JSON key, a closing brace), they are
a round's drafts, one-hot.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specserve.errors import InvalidArgument

KINDS = ("json_schema", "regex", "choice", "lark")
COMPILED_CACHE = 64  # compiled grammars kept, by their text
# JSON's whitespace at each place: one space, or a line break and its indent. Pretty printed
# and compact JSON match; a model that would go on with blank lines or runs of spaces (as
# small ones do inside a grammar) ends its value instead.
JSON_WHITESPACE = {"whitespace_pattern": r"( |\r?\n[ \t]{0,32})?"}
COMPACT_JSON = {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What the output must match. text: the JSON schema (JSON text), the regex, the choices
    (a JSON list of strings) or the Lark grammar (llguidance's dialect; a GBNF grammar, with
    `::=`, is converted)."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"grammar kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    @classmethod
    def choice(cls, choices: list[str]) -> Grammar:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidArgument("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def json_schema(cls, schema: dict | str | bool, compact: bool = False) -> Grammar:
        """compact: no whitespace but after separators (", ", ": "); else JSON's own, as
        much as the model likes."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise InvalidArgument(f"the JSON schema is not JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument("a JSON schema is an object")
        if compact:  # llguidance reads its options from the schema's x-guidance
            schema = {**({} if schema is True else schema), "x-guidance": COMPACT_JSON}
        return cls("json_schema", json.dumps(schema))  # its order is the properties'

    def llguidance(self) -> str:
        """The grammar as llguidance's LLMatcher takes it."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            own = '"x-guidance"' in self.text  # the schema's own options take the place of ours
            return LLMatcher.grammar_from_json_schema(self.text, defaults=None if own else JSON_WHITESPACE)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.text)))
        if "::=" in self.text:  # GBNF (llama.cpp's, and vLLM's EBNF examples)
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return LLMatcher.grammar_from_lark(gbnf_to_lark(self.text))
        return LLMatcher.grammar_from_lark(self.text)

    def to_proto(self):
        from specserve.v1 import common_pb2

        if self.kind == "choice":
            return common_pb2.Grammar(choice=common_pb2.Choices(choices=json.loads(self.text)))
        return common_pb2.Grammar(**{self.kind: self.text})

    @classmethod
    def from_proto(cls, message) -> Grammar | None:
        kind = message.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls.choice(list(message.choice.choices))
        return cls(kind, getattr(message, kind))


class Grammars:
    """Grammars compiled for one tokenizer: each new session's state is a copy of its
    grammar's compiled start, kept by the grammar's text (COMPILED_CACHE of them)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer = None
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()  # the gateway checks grammars on several threads

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
            )
        return self._tokenizer

    def compiled(self, grammar: Grammar):
        """A matcher of grammar at its start, its own; InvalidArgument naming the problem
        where llguidance refuses the grammar."""
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher.deep_copy()
            try:
                text = grammar.llguidance()
            except ValueError as error:
                raise InvalidArgument(f"{grammar.kind}: {error}") from None
            matcher = LLMatcher(self._ll_tokenizer(), text, log_level=0)
            if matcher.is_error():
                raise InvalidArgument(f"{grammar.kind}: {first_line(matcher.get_error())}")
            self._compiled[grammar] = matcher
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
            return matcher.deep_copy()

    def start(self, grammar: Grammar, output: list[int] = ()) -> GrammarState:
        """A session's state after output (tokens it holds already: a rebuilt session);
        InvalidArgument where the grammar refuses them."""
        state = GrammarState(self.compiled(grammar), self.vocab_size, self.eos_token_ids)
        if output and not state.advance(list(output)):
            raise InvalidArgument("the output so far does not follow the grammar")
        return state


def first_line(message: str, limit: int = 300) -> str:
    """llguidance's error on one line (its own spans several, with a caret under the spot)."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip() and line.strip() != "^")
    return (text or "invalid grammar")[:limit]


class GrammarState:
    """One session's place in its grammar, after the tokens it has made. Methods that look
    ahead (legal, masks, masked) leave it where it was."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._past_end = False  # an end-of-sequence token made (under ignore_eos, output goes on)

    @property
    def ended(self) -> bool:
        """Past its end (an end-of-sequence token made, or a token it refused): the output
        is no longer constrained."""
        return self._past_end or self.matcher.is_error()

    def advance(self, tokens: list[int]) -> bool:
        """Consumes the round's tokens; False where the grammar refused one (it has ended)."""
        if self.ended:
            return True
        ends = [i for i, token in enumerate(tokens) if token in self.eos_token_ids]
        if not ends:
            return self.matcher.consume_tokens(list(tokens))
        self._past_end = True  # llguidance takes an end-of-sequence token one at a time only
        before = list(tokens[: ends[0]])
        return (not before or self.matcher.consume_tokens(before)) and self.matcher.consume_token(tokens[ends[0]])

    def legal(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the grammar allows here."""
        if self.ended:
            return len(tokens)
        return self.matcher.validate_tokens(list(tokens))

    def forced(self) -> list[int]:
        """The tokens the grammar leaves no choice of here (jump-forward)."""
        if self.ended or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()

    def bitmasks(self, paths: list[list[int]]) -> np.ndarray:
        """Per path (tokens after the state), the tokens the grammar allows after it, a bit
        each: int32 [len(paths), words]. A path the grammar refuses (its row is never read)
        and a state past its end allow every token. Makes no torch op (it may run beside the
        forward, on another thread)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bits = allocate_token_bitmask(len(paths), self.vocab_size)  # [rows, words], all allowed
        for r, path in enumerate(paths if not self.ended else ()):
            consumed = self.matcher.try_consume_tokens(list(path)) if path else 0
            if consumed < len(path):
                self.matcher.rollback(consumed)
                continue
            fill_next_token_bitmask(self.matcher, bits, r)
            if path:
                self.matcher.rollback(len(path))
        return bits

    def allowed(self, bits: np.ndarray) -> torch.Tensor:
        """bitmasks' rows as bool [rows, vocab]; a row that allows nothing (an end consumed)
        allows everything: past its end the output is not constrained."""
        little = bits.astype("<i4", copy=False).view(np.uint8)  # token 32w + i is bit i of word w
        unpacked = np.unpackbits(little, axis=-1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(unpacked.astype(bool))  # [rows, vocab]
        allowed[~allowed.any(-1)] = True
        return allowed

    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        """Per path, the tokens the grammar allows after it: bool [len(paths), vocab]."""
        return self.allowed(self.bitmasks(paths))

    def masked(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits [rows, vocab'] with the tokens the grammar forbids after each path at -inf
        (vocab' may differ from the target's: a draft's output layer)."""
        return mask_with(logits, self.masks(paths))


def mask_with(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab'] with the ids that allowed [rows, vocab] refuses at -inf. vocab'
    may be narrower or wider than vocab (a draft's output layer): an id past the vocabulary
    is refused."""
    width = logits.shape[-1]
    if width > allowed.shape[1]:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], width - allowed.shape[1])], 1)
    return logits.masked_fill(~allowed[:, :width].to(logits.device), float("-inf"))
