"""Token trees: the shape a round's drafts follow, and the branches a tree is verified on.

A tree's node 0 is its root, the last verified token; nodes 1 .. N are draft tokens, each
listed after its parent. A shape says, per draft node, its parent and its rank: the rank-th
most likely token after the parent (greedy), or the rank-th independent draw from the
draft's distribution there (sampled; docs/design.md, "Token trees"). Shapes are written as
children per depth ([3, 2, 1, 1]: three children of the root, two of each of those, ...) or
as paths of ranks from the root ([[0], [0, 0], [1]]: the top token, the top token after it,
and the second token after the root), Medusa's "choices". A chain of K is [1] * K.

Nodes are kept in depth-first order with the first-ranked child first, so node 1, 2, ... down
the first children is the chain a chain speculation would draft, and branch 0 follows it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

# A tree has at most this many draft nodes: with its root, it is verified as one compiled step
# of rows (specserve/model/llama.py, EXACT_MAX_QUERIES).
MAX_TREE_NODES = 15


class TreeShapeError(ValueError):
    """A shape that is not a tree this server drafts."""


@dataclass(frozen=True)
class TreeShape:
    """Draft nodes 1 .. N as (parent, rank), depth-first with the first-ranked child first."""

    nodes: tuple[tuple[int, int], ...]

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls(tuple((i, 0) for i in range(k)))

    @classmethod
    def from_children_per_depth(cls, children: Sequence[int]) -> TreeShape:
        """Every node at depth d has children[d] children."""
        if not children or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in children):
            raise TreeShapeError("children per depth must be positive integers, at least one depth")
        paths: list[tuple[int, ...]] = []
        frontier: list[tuple[int, ...]] = [()]
        for count in children:
            frontier = [(*path, rank) for path in frontier for rank in range(count)]
            paths.extend(frontier)
            if len(paths) > MAX_TREE_NODES:
                break
        return cls.from_paths(paths)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TreeShape:
        """Each path the ranks from the root to a node; every path's prefixes are paths too."""
        unique = set()
        for path in paths:
            if not isinstance(path, (list, tuple)) or not path:
                raise TreeShapeError("a tree path is a non-empty list of ranks")
            if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
                raise TreeShapeError(f"ranks are integers >= 0, got {list(path)}")
            unique.add(tuple(path))
        if len(unique) != len(paths):
            raise TreeShapeError("a tree path is listed twice")
        if len(unique) > MAX_TREE_NODES:
            raise TreeShapeError(f"a tree has at most {MAX_TREE_NODES} draft nodes, this one {len(unique)}")
        for path in unique:
            if len(path) > 1 and path[:-1] not in unique:
                raise TreeShapeError(f"path {list(path)} needs its prefix {list(path[:-1])}")
        index: dict[tuple[int, ...], int] = {(): 0}
        nodes: list[tuple[int, int]] = []
        for path in sorted(unique):  # depth-first, first-ranked child first
            index[path] = len(nodes) + 1
            nodes.append((index[path[:-1]], path[-1]))
        return cls(tuple(nodes))

    @classmethod
    def parse(cls, value) -> TreeShape:
        """From JSON or a Python value: a list of ints (children per depth), a list of lists
        (paths), or text of either ("3,2,1,1" or "[[0],[1]]")."""
        if isinstance(value, str):
            text = value.strip()
            try:
                value = json.loads(text if text.startswith("[") else f"[{text}]")
            except json.JSONDecodeError as error:
                raise TreeShapeError(f"cannot read tree {text!r}: {error.msg}") from None
        if isinstance(value, TreeShape):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
            return cls.from_paths(value)
        if isinstance(value, (list, tuple)):
            shape = cls.from_children_per_depth(value)
            if len(shape) > MAX_TREE_NODES:
                raise TreeShapeError(f"a tree has at most {MAX_TREE_NODES} draft nodes; {list(value)} makes more")
            return shape
        raise TreeShapeError("a tree is children per depth ([3, 2, 1]) or a list of paths ([[0], [1], [0, 0]])")

    @classmethod
    def from_proto(cls, message) -> TreeShape | None:
        """From a TokenTree message; None for an empty one (a chain)."""
        if not message.parents and not message.ranks:
            return None
        parents, ranks = list(message.parents), list(message.ranks)
        if len(parents) != len(ranks):
            raise TreeShapeError(f"a tree's parents ({len(parents)}) and ranks ({len(ranks)}) differ in number")
        problem = check_parents(parents, len(parents))
        if problem is not None:
            raise TreeShapeError(problem)
        paths: list[tuple[int, ...]] = [()]
        for parent, rank in zip(parents, ranks):
            paths.append((*paths[parent], rank))
        return cls.from_paths(paths[1:])

    def to_proto(self):
        from specserve.v1 import common_pb2

        return common_pb2.TokenTree(parents=self.parents, ranks=self.ranks)

    def within_depth(self, depth: int) -> TreeShape | None:
        """The shape's nodes at most depth deep (None: none are)."""
        node_depths = depths((-1, *self.parents))
        kept = [n for n in range(len(node_depths)) if node_depths[n] <= depth]
        if len(kept) == 1:
            return None
        if len(kept) == len(node_depths):
            return self
        parents = renumber((-1, *self.parents), kept)
        return TreeShape(tuple((parents[i], self.nodes[n - 1][1]) for i, n in enumerate(kept) if n))

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def parents(self) -> tuple[int, ...]:
        """Parent of each draft node (0: the root)."""
        return tuple(parent for parent, _ in self.nodes)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for _, rank in self.nodes)

    @property
    def is_chain(self) -> bool:
        return all(parent == i and rank == 0 for i, (parent, rank) in enumerate(self.nodes))

    def depth(self) -> int:
        return max(depths((-1, *self.parents)), default=0)

    def paths(self) -> list[list[int]]:
        """Each node's ranks from the root, in node order (what from_paths takes)."""
        paths: dict[int, tuple[int, ...]] = {0: ()}
        for i, (parent, rank) in enumerate(self.nodes, start=1):
            paths[i] = (*paths[parent], rank)
        return [list(paths[i]) for i in range(1, len(self.nodes) + 1)]

    def describe(self) -> str:
        """The shape as paths of ranks, for logs and errors."""
        return json.dumps(self.paths(), separators=(",", ":"))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a tree given each node's parent (the root's is -1)."""
    out = [0] * len(parents)
    for node in range(1, len(parents)):
        out[node] = out[parents[node]] + 1
    return out


def check_parents(parents: Sequence[int], num_drafts: int) -> str | None:
    """What is wrong with draft parents as a request sends them (parent of draft i, 1-based
    nodes, 0 the root), or None."""
    if len(parents) != num_drafts:
        return f"{num_drafts} draft tokens need {num_drafts} parents, got {len(parents)}"
    for i, parent in enumerate(parents, start=1):
        if not 0 <= parent < i:
            return f"draft {i}'s parent {parent} is not an earlier node (0 is the root)"
    return None


def branches(parents: Sequence[int]) -> list[list[int]]:
    """The branches of a tree (parents of nodes 0 .. N, the root's -1): per node, the indices
    of the root-to-leaf paths it lies on, leaves in node order (branch 0 ends at the first)."""
    has_child = [False] * len(parents)
    for parent in parents[1:]:
        has_child[parent] = True
    on: list[list[int]] = [[] for _ in parents]
    leaves = [node for node in range(len(parents)) if not has_child[node]]
    for branch, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            on[node].append(branch)
            node = parents[node]
    return on


def prune_to_branches(parents: Sequence[int], keep: int) -> list[int]:
    """The nodes (in order) on a tree's first keep branches: what a round verifies when only
    that many cache slots are free. Dropping nodes by their place in the tree, never by their
    tokens, keeps a sampled tree's rule exact."""
    return [node for node, on in enumerate(branches(parents)) if on[0] < keep]


def renumber(parents: Sequence[int], kept: Sequence[int]) -> list[int]:
    """The parents of a subtree of kept nodes (root included, parents kept with their children),
    renumbered in kept's order."""
    new = {node: i for i, node in enumerate(kept)}
    return [-1 if node == 0 else new[parents[node]] for node in kept]
