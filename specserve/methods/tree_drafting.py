"""Drafting a token tree (docs/design.md, "Token trees"): after the catch-up, one forward per
depth over every session's nodes that have children in its shape, each node on the branches
(cache slots) of its paths, as the verifier lays them out.

A node's children are its parent's top tokens by rank (greedy), or independent draws from
the draft's distribution after it, with replacement (sampled): what the verifier's
multi-candidate rule needs to be exact. A draw that repeats an earlier sibling is kept, as a
leaf: it can never be accepted (its first copy was rejected, which leaves no mass on it),
but its rejection is part of the rule.
"""

from __future__ import annotations

import torch

from specserve.methods.trees import branches, depths, prune_to_branches, renumber
from specserve.model.backends import Backend, TreeNodes
from specserve.protocol import SparseDistribution
from specserve.sampling import processed_probs, sample_sparse, truncate_to_support


class TreePlan:
    """One session's tree as it is drafted."""

    def __init__(self, drafting, backend: Backend, root_logits: torch.Tensor):
        self.drafting = drafting
        job = drafting.job
        room = max(0, drafting.k)  # the depth the context window leaves
        parents = [-1, *job.tree.parents]
        ranks = [0, *job.tree.ranks]
        node_depths = depths(parents)
        kept = [n for n in range(len(parents)) if node_depths[n] <= room]
        parents, ranks = renumber(parents, kept), [ranks[n] for n in kept]
        on = branches(parents)
        wanted = max(b for node in on for b in node) + 1
        allowed = backend.reserve_branches(job.session.sequence, wanted) if len(parents) > 1 else 1
        if allowed < wanted:
            kept = prune_to_branches(parents, allowed)
            parents, ranks = renumber(parents, kept), [ranks[n] for n in kept]
            on = branches(parents)
        self.parents, self.ranks, self.on = parents, ranks, on
        self.depths = depths(parents)
        self.children: list[list[int]] = [[] for _ in parents]
        for node in range(1, len(parents)):
            self.children[parents[node]].append(node)
        self.tokens = [drafting.verified[-1]] + [-1] * (len(parents) - 1)
        self.logits: dict[int, torch.Tensor] = {0: root_logits}
        self.distributions: dict[int, SparseDistribution] = {}  # after a node: its children's q
        self.repeats: set[int] = set()  # draws that repeat an earlier sibling: leaves
        self.fed: list[int] = []

    def expand(self, depth: int, support_size: int) -> list[int]:
        """Draws the children of the nodes at depth; the new nodes that have children of their
        own, to be fed."""
        for node in range(len(self.parents)):
            if self.depths[node] == depth and self.children[node] and node in self.logits:
                self._draw_children(node, support_size)
        return [
            node
            for node in range(len(self.parents))
            if self.depths[node] == depth + 1 and self.children[node] and self._drafted(node)
        ]

    def _drafted(self, node: int) -> bool:
        """Whether node was drawn and no repeat lies on its path."""
        while node > 0:
            if node in self.repeats or self.tokens[node] < 0:
                return False
            node = self.parents[node]
        return True

    def _draw_children(self, node: int, support_size: int) -> None:
        job = self.drafting.job
        sampling, position = job.sampling, len(self.drafting.verified) + self.depths[node]
        logits = self.drafting.processed(self.logits[node], self._path(node))
        if sampling.is_greedy:
            top = torch.topk(logits, max(self.ranks[c] for c in self.children[node]) + 1).indices.tolist()
            for child in self.children[node]:
                self.tokens[child] = top[self.ranks[child]]
            return
        ids, q = truncate_to_support(processed_probs(logits[None], sampling)[0], support_size)
        self.distributions[node] = SparseDistribution(tuple(ids.tolist()), tuple(q.tolist()))
        seen = set()
        for child in self.children[node]:
            token = sample_sparse(ids, q, sampling.seed, position, draw=self.ranks[child])
            self.tokens[child] = token
            if token in seen:
                self.repeats.add(child)
            seen.add(token)

    def _path(self, node: int) -> list[int]:
        """The drafts from the root to node, node's included."""
        path = []
        while node > 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]

    def nodes(self, fed: list[int]) -> TreeNodes:
        self.fed.extend(fed)
        sequence = self.drafting.job.session.sequence
        return TreeNodes(
            sequence,
            len(self.drafting.verified) - 1,
            [self.tokens[n] for n in fed],
            [self.depths[n] for n in fed],
            [self.on[n] for n in fed],
        )

    def finish(self) -> None:
        """The drafting's drafts, their parents and distributions; the session's cache then
        holds the nodes of branch 0 it was fed (the first chain), which the next round's
        catch-up keeps where they were accepted."""
        d = self.drafting
        kept = [n for n in range(len(self.parents)) if self.tokens[n] >= 0 and self._kept(n)]
        d.parents = renumber(self.parents, kept)[1:]
        d.drafts = [self.tokens[n] for n in kept[1:]]
        if not d.job.sampling.is_greedy:
            d.distributions = [self.distributions[self.parents[n]] for n in kept[1:]]
        first_chain = sorted((n for n in self.fed if self.on[n][0] == 0), key=lambda n: self.depths[n])
        session = d.job.session
        session.cached_tokens.extend(self.tokens[n] for n in first_chain)
        session.sequence.length = len(session.cached_tokens)

    def _kept(self, node: int) -> bool:
        """Whether node is on no repeat's subtree (a repeat itself is kept)."""
        node = self.parents[node]
        while node > 0:
            if node in self.repeats:
                return False
            node = self.parents[node]
        return True


def draft_trees(drafter, backend: Backend, batch: list) -> None:
    """Drafts every job of batch (drafter's _Drafting, each with a tree) on backend."""
    logits, _ = drafter._catch_up(backend, [drafter._catch_up_row(d) for d in batch])
    plans = [TreePlan(d, backend, row_logits) for d, row_logits in zip(batch, logits)]
    depth = 0
    while True:
        fed = [(plan, plan.expand(depth, drafter.options.support_size)) for plan in plans]
        fed = [(plan, nodes) for plan, nodes in fed if nodes]
        if not fed:
            break
        parts = [plan.nodes(nodes) for plan, nodes in fed]
        for (plan, nodes), (node_logits, _) in zip(fed, backend.forward_trees(parts)):
            plan.logits.update(zip(nodes, node_logits))
        depth += 1
    for plan in plans:
        plan.finish()
