"""A token tree's round in the verifier (docs/design.md, "Token trees"): its checks, its
nodes laid out on branches (a cache slot each) for one forward, and the path it keeps.

Every node is fed at position (sequence length + its depth) on each branch it lies on, and
reads the branch of its first: it sees the context and its ancestors, as the chain of its
path would, to the bit. Where the verifier has fewer free cache slots than the tree has
branches, the round verifies the first branches only; dropping nodes by their place in the
tree, never by their tokens, keeps a sampled tree's rule exact.
"""

from __future__ import annotations

from specserve.errors import InvalidArgument, require
from specserve.methods.trees import MAX_TREE_NODES, branches, check_parents, depths, prune_to_branches, renumber
from specserve.model.backends import Backend, TreeNodes


def check_tree(job, sampling, supported: bool) -> None:
    """A tree request's own checks, past those of its drafts as a chain's."""
    if not supported:
        raise InvalidArgument("token trees need the runner backend (this target is served by transformers)")
    k = len(job.draft_token_ids)
    require(k <= MAX_TREE_NODES, f"a token tree has at most {MAX_TREE_NODES} draft tokens, got {k}")
    problem = check_parents(job.draft_parents, k)
    require(problem is None, problem or "")
    if sampling.is_greedy:
        return
    first_child: dict[int, int] = {}
    for i, parent in enumerate(job.draft_parents):
        sibling = first_child.setdefault(parent, i)
        require(
            job.draft_distributions[i] == job.draft_distributions[sibling],
            f"draft {i + 1} must carry the distribution its siblings were drawn from (draft {sibling + 1}'s)",
        )


def check_tree_speculation(tree, supported: bool, max_speculative_tokens: int) -> None:
    """A Decode call's tree, before its first round."""
    if not supported:
        raise InvalidArgument("token trees need the runner backend (this target is served by transformers)")
    require(
        len(tree) <= max_speculative_tokens,
        f"a tree of {len(tree)} nodes passes this verifier's {max_speculative_tokens} draft tokens per round",
    )


def tree_nodes(backend: Backend, row) -> TreeNodes:
    """The row's nodes for the forward, on as many branches as the backend has room for (the
    row pruned to them)."""
    sequence = row.session.sequence
    on = branches(row.parents)
    wanted = max(b for node in on for b in node) + 1
    room = backend.reserve_branches(sequence, wanted)
    if room < wanted:
        kept = prune_to_branches(row.parents, room)
        if row.window:  # a lookahead round's window comes last: its nodes kept, and whether all were
            first = len(row.feed) - row.window
            row.window = sum(node >= first for node in kept)
            row.window_whole = False
        row.parents = renumber(row.parents, kept)
        row.feed = [row.feed[node] for node in kept]
        row.drafts = tuple(row.feed[1:])
        if row.distributions:  # the candidates' (a lookahead window's nodes have none)
            row.distributions = tuple(
                row.distributions[node - 1] for node in kept[1:] if node <= len(row.distributions)
            )
        on = branches(row.parents)
    return TreeNodes(sequence, sequence.length, list(row.feed), depths(row.parents), on)


def split_window(row) -> list[int] | None:
    """Takes a lookahead round's window nodes off the row after its forward, so that its
    decision reads the candidates only; the target's argmax at the window's nodes (None
    where some were not fed)."""
    end = len(row.feed) - row.window
    argmax = row.argmax[end:] if row.argmax is not None else row.logits[end:].argmax(-1).tolist()
    row.feed, row.parents, row.logits = row.feed[:end], row.parents[:end], row.logits[:end]
    row.argmax = row.argmax[:end] if row.argmax is not None else None
    row.drafts = tuple(row.feed[1:])
    return argmax if row.window_whole else None


def keep_path(backend: Backend, row) -> list[int]:
    """Keeps the cache of the nodes the decision kept (the root's and theirs, moved into the
    sequence's own slot); their tokens."""
    path = row.path
    branch = branches(row.parents)[path[-1]][0] if path else 0
    sequence = row.session.sequence
    backend.keep_branch(sequence, branch, sequence.length + len(path) + 1)
    return [row.feed[node] for node in path]
