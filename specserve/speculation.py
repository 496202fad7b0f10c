"""How a session speculates: the settings a request asks for (its method, K or where an
adaptive choice of K starts, a token tree, lookahead's shape). The choice of each round's K
from what the sessions measure is specserve/adaptive.py's."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import InvalidArgument, require
from specserve.methods import registry
from specserve.methods.lookahead import LookaheadShape
from specserve.methods.trees import TreeShape, TreeShapeError
from specserve.v1 import verify_pb2


@dataclass(frozen=True)
class Speculation:
    """What a request asks of its rounds; num_speculative_tokens is K, or where an adaptive
    choice starts."""

    method: str = "draft_model"
    num_speculative_tokens: int = 4
    adaptive: bool = True
    k_bounds: tuple[int, int] = (0, 8)  # the adaptive choice's range; 0: it may stop drafting
    min_draft_probability: float = 0.0
    tree: TreeShape | None = None  # each round a token tree of this shape; None: chains
    tenant: str = ""  # method suffix learns from the same tenant's sessions, or from none if isolated
    isolated: bool = False  # (a seeded sampled request: its output must not depend on other requests)
    lookahead: tuple[int, int, int] = (0, 0, 0)  # method lookahead's W, N, G; 0: the verifier's default

    def __post_init__(self) -> None:
        spec = registry.spec_of(self.method)  # raises, naming the methods, for a name that is none
        chains_only = f"token trees are drafted by {', '.join(registry.tree_methods())}; {self.method} drafts chains"
        require(self.tree is None or spec.trees, chains_only)
        require(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1")
        low, high = self.k_bounds
        bounds = f"adaptive K bounds must satisfy 0 <= min <= max, max >= 1; got {low}, {high}"
        require(0 <= low <= high and high >= 1, bounds)
        require(0 <= self.min_draft_probability <= 1, "min_draft_probability must lie in [0, 1]")
        require(self.method == "lookahead" or not any(self.lookahead), "lookahead settings need method lookahead")
        LookaheadShape().with_settings(self.lookahead)  # raises for a setting out of its range

    @classmethod
    def from_proto(cls, message: verify_pb2.Speculation) -> Speculation:
        return cls(
            method=message.method or "draft_model",
            num_speculative_tokens=message.num_speculative_tokens,
            adaptive=message.adaptive,
            k_bounds=(message.adaptive_k_min, message.adaptive_k_max or message.num_speculative_tokens),
            min_draft_probability=message.min_draft_probability,
            tree=tree_of(message.tree),
            tenant=message.tenant,
            isolated=message.isolated,
            lookahead=(message.lookahead.window, message.lookahead.ngram, message.lookahead.guesses),
        )

    def to_proto(self) -> verify_pb2.Speculation:
        return verify_pb2.Speculation(
            method=self.method,
            num_speculative_tokens=self.num_speculative_tokens,
            adaptive=self.adaptive,
            adaptive_k_min=self.k_bounds[0],
            adaptive_k_max=self.k_bounds[1],
            min_draft_probability=self.min_draft_probability,
            tree=self.tree.to_proto() if self.tree is not None else None,
            tenant=self.tenant,
            isolated=self.isolated,
            lookahead=verify_pb2.Lookahead(**dict(zip(("window", "ngram", "guesses"), self.lookahead))),
        )


def tree_of(message) -> TreeShape | None:
    """A TokenTree message's shape (None: a chain); a bad one is an InvalidArgument."""
    try:
        return TreeShape.from_proto(message)
    except TreeShapeError as error:
        raise InvalidArgument(str(error)) from None
