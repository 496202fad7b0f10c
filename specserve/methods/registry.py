"""The speculation methods: one spec each, written here once. The gateway's request check,
the CLI's and the services' choices, the bench's rows, what each service says it serves
and where a round is drafted are read from these specs, not from lists of names.

Adding a method is a module in specserve/methods/ and, below, its import and a register()
line (docs/design.md, "Methods and adding one"). A method that drafts from the sequence alone gives a
`context` factory: the drafter (specserve/drafting.py) then serves it in the draft service
and in the verifier, greedy and sampled (its drafts are one-hot), with no other change. A
module outside the project registers its methods the same way: name it in
SPECSERVE_METHOD_MODULES (comma-separated; every service imports it at start, while this
registry is being imported, so at import time such a module imports only the registry and
what its proposer needs, and the project's other modules inside its functions).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specserve.errors import InvalidArgument
from specserve.methods.ngram import NgramProposer
from specserve.methods.suffix import SuffixStore

NONE = "none"  # no method: target-only rounds
VERIFIER = "verifier"  # drafted by the verifier itself (colocated: no call per round)
DRAFT_SERVICE = "draft_service"  # drafted by a draft service too, for the gateway's rounds


class ContextProposer(Protocol):
    """A method that drafts from a session's sequence (and what it learned from earlier
    ones), with no model: its drafts are deterministic, so their q is one-hot."""

    def open(self, tenant: str, isolated: bool) -> object:
        """A new session's state (isolated: it learns from no other session)."""

    def drafts(self, state: object, verified: list[int], start: int, k: int) -> list[int]:
        """Up to k drafts after verified, whose tokens from start on are new to the state."""

    def finish(self, state: object, tokens: list[int]) -> None:
        """The session ended with tokens: what a later session may learn from."""


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    where: frozenset[str]  # VERIFIER, DRAFT_SERVICE: the services that draft it
    needs: str = ""  # what must be loaded to serve it ("" nothing: always served where it runs)
    model: bool = False  # drafts with a model of its own (a draft model, the target's first layers)
    trees: bool = False  # drafts token trees as well as chains
    context: Callable[[object], ContextProposer] | None = None  # (DraftOptions) -> proposer: model-free


SPECS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Adds a method (a name already taken is an error: names are the API's)."""
    if spec.name in SPECS or spec.name == NONE:
        raise ValueError(f"speculation method {spec.name!r} is registered already")
    if spec.context is not None and spec.model:
        raise ValueError(f"{spec.name}: a method drafts from a model or from the context, not both")
    SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    SPECS.pop(name, None)


def names(where: str | None = None) -> tuple[str, ...]:
    """Every method's name, in the order registered (where: those drafted there)."""
    return tuple(name for name, spec in SPECS.items() if where is None or where in spec.where)


def spec_of(name: str) -> MethodSpec:
    """The method's spec; an InvalidArgument that names the methods for an unknown name."""
    spec = SPECS.get(name)
    if spec is None:
        raise InvalidArgument(f"speculation method must be one of {', '.join(names())}, got {name!r}")
    return spec


def tree_methods() -> tuple[str, ...]:
    return tuple(name for name, spec in SPECS.items() if spec.trees)


BOTH = frozenset({VERIFIER, DRAFT_SERVICE})

register(
    MethodSpec(
        "draft_model",
        "a small draft model of the target's tokenizer",
        BOTH,
        needs="a draft model",
        model=True,
        trees=True,
    )
)
register(
    MethodSpec(
        "early_exit",
        "the target's first layers, final norm and LM head",
        BOTH,
        needs="an early-exit model",
        model=True,
        trees=True,
    )
)
register(
    MethodSpec(
        "ngram",
        "copies what followed the latest earlier occurrence of the sequence's end",
        BOTH,
        context=lambda options: NgramProposer(options.ngram_max),
    )
)
register(
    MethodSpec(
        "suffix",
        "follows counts of what followed the sequence's end, in its own and its tenant's sessions",
        BOTH,
        context=lambda options: SuffixStore(),
    )
)
register(
    MethodSpec(
        "medusa", "heads on the target's last hidden state", frozenset({VERIFIER}), needs="Medusa heads", trees=True
    )
)
register(
    MethodSpec(
        "eagle",
        "a head that guesses the target's next hidden states from its last ones",
        frozenset({VERIFIER}),
        needs="an EAGLE head",
    )
)
register(
    MethodSpec(
        "lookahead",
        "the target's own guesses in a Jacobi window fed beside the round",
        frozenset({VERIFIER}),
        needs="the runner backend",
    )
)


def load_method_modules(modules: str) -> None:
    """Imports each module named (comma-separated): each registers its methods."""
    for name in (m.strip() for m in modules.split(",")):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ImportError(
                f"SPECSERVE_METHOD_MODULES names {name!r}, which does not import: {error} (a method module is "
                "imported with the registry: at import time it may import only the registry and what its "
                "proposer needs)"
            ) from error


load_method_modules(os.environ.get("SPECSERVE_METHOD_MODULES", ""))
