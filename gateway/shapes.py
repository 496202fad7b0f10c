"""The shapes a request asks its rounds to take: a token tree (speculation.tree) and method
lookahead's window and candidates (speculation.lookahead), checked against what is served;
a 400 naming the field for one that is not a shape or does not fit."""

from __future__ import annotations

from gateway.clients import ServedModel
from gateway.errors import bad_request
from specserve.errors import InvalidArgument
from specserve.methods import registry
from specserve.methods.lookahead import LookaheadShape
from specserve.methods.trees import TreeShape, TreeShapeError


def tree_of_request(asked, default: str, method: str, served: ServedModel) -> TreeShape | None:
    """The request's token tree: asked, or the gateway's default for the model methods; a
    400 for a shape that is not one or does not fit."""
    if asked is None:
        spec = registry.SPECS.get(method)
        return TreeShape.parse(default) if default and spec is not None and spec.model and spec.trees else None
    if method not in registry.tree_methods():
        trees = ", ".join(registry.tree_methods())
        raise bad_request(f"a token tree needs a method that drafts trees ({trees}), not {method}", "speculation.tree")
    try:
        tree = TreeShape.parse(asked)
    except TreeShapeError as error:
        raise bad_request(f"speculation.tree: {error}", "speculation.tree") from None
    if len(tree) > served.max_speculative_tokens:
        raise bad_request(
            f"speculation.tree has {len(tree)} nodes; at most {served.max_speculative_tokens} draft tokens per round",
            "speculation.tree",
        )
    return tree


def lookahead_of_request(asked, method: str) -> tuple[int, int, int]:
    """The request's (W, N, G), 0 where unset (the verifier's default); a 400 for a setting
    out of its range or without method lookahead."""
    if asked is None:
        return (0, 0, 0)
    if method != "lookahead":
        raise bad_request(f"speculation.lookahead needs method lookahead, not {method}", "speculation.lookahead")
    settings = (asked.window, asked.ngram, asked.guesses)
    if any(value is not None and value < 1 for value in settings):
        raise bad_request("speculation.lookahead's window, ngram and guesses are >= 1", "speculation.lookahead")
    settings = tuple(value or 0 for value in settings)
    try:
        LookaheadShape().with_settings(settings)
    except InvalidArgument as error:
        raise bad_request(f"speculation.lookahead: {error}", "speculation.lookahead") from None
    return settings
