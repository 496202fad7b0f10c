"""Medusa rounds: the verifier drafts a session's next round from the hidden state its last
forward left (the normed hidden state of the position whose logits gave the session's last
token), with Medusa heads beside the target (specserve/methods/medusa.py). No draft model runs and
there is no draft step: the heads are one small product per head and the target's own LM
head over them, for every row of the batch at once.

Head i at the last position guesses the token i + 1 after the session's last token. A
round's chain is a copy of the context first, where the sequence's last token occurred
before (the ngram method's lookup, specserve/methods/ngram.py), then the heads' top tokens
at the positions after it: the heads guess every position from one hidden state, so their
guess for a position holds whatever the copy put before it. The copy comes first because on
the demo target even a one-token match's copy holds more often than the heads' guesses
(docs/design.md, "Medusa heads"); copy_min_ngram 0 turns it off. A tree (greedy only) takes the
shape's rank r at depth d to be the d-th candidate list's r-th token: the chain's token
first, then the head's other top tokens.

Every candidate is a deterministic function of the verified sequence, so its q is one-hot:
the chain rule accepts it with probability p(x) and, rejected, draws from p without it,
which is sampling from p. A sampled round drafts the chain only: the verifier's sampled tree
rule is exact for siblings drawn from one distribution, and Medusa's siblings are a top-k.
"""

from __future__ import annotations

import torch

from specserve.methods.medusa import MedusaHeads, residual_block
from specserve.methods.ngram import ngram_drafts, one_hot
from specserve.methods.trees import TreeShape
from specserve.model.linear import Linear


class MedusaDrafting:
    def __init__(
        self, heads: MedusaHeads, lm_head: Linear, ngram_max: int, copy: bool = True, eos_token_ids: tuple = ()
    ):
        """lm_head: the target runner's (eos_token_ids: the target's, for logits processing).
        The heads' matrices are multiplied as one, in the LM
        head's dtype (a 16-bit one prepacked: each round's product is one row per head)."""
        self.num_heads = heads.config.num_heads
        weight = torch.cat([head.weight for head in heads.heads]).detach()  # [heads * hidden, hidden]
        bias = torch.cat([head.bias for head in heads.heads]).detach()
        weight, bias = (tensor.to(device=lm_head.device, dtype=lm_head.dtype) for tensor in (weight, bias))
        self.heads = Linear(weight, bias)  # row-independent, as the LM head: a row's drafts are its own
        self.lm_head = lm_head
        self.ngram_max = ngram_max
        self.copy = copy
        self.eos_token_ids = eos_token_ids

    @torch.inference_mode()
    def propose(self, rows: list[tuple[list[int], torch.Tensor | None, int, TreeShape | None, bool]], process=None):
        """Per row (verified tokens, hidden state, k, tree or None, greedy): (drafts, their q,
        the tree's parents or ()). The heads run only where a round needs their guesses: a
        copy that fills a chain needs none. process: per row, None or the request's logits
        processing as a function (logits [vocab], the drafts before the position) -> logits;
        such a row drafts a chain, each head's token the argmax of its processed logits."""
        process = process or [None] * len(rows)
        plans = []
        for (verified, hidden, k, tree, greedy), processed in zip(rows, process):
            depth = tree.depth() if tree is not None else k
            tree = tree if greedy and processed is None else None  # else the tree's first branch
            copy = ngram_drafts(verified, depth, self.ngram_max) if self.copy else []
            first = 0 if tree is not None else len(copy)  # a tree's other ranks need every depth's guesses
            heads = range(first, min(depth, self.num_heads)) if hidden is not None else range(0)
            plans.append((copy[:depth], depth, tree, heads))
        width = max((max(tree.ranks) + 1 for _, _, tree, _ in plans if tree is not None), default=1)
        asked = [(row[1], plan[3], processed is not None) for row, plan, processed in zip(rows, plans, process)]
        guesses = self._top(asked, width)
        out = []
        for (copy, depth, tree, heads), row, candidates, processed in zip(plans, rows, guesses, process):
            chain = list(copy)
            for head in range(len(copy), depth):
                if head not in heads:  # no hidden state, or past the last head
                    break
                guess = candidates[head]
                chain.append(guess[0] if processed is None else int(processed(guess, chain).argmax()))
            if tree is None:
                out.append((tuple(chain), () if row[4] else one_hot(chain), ()))
            else:
                drafts, parents = _tree_nodes(tree, chain, [candidates[head] for head in heads])
                out.append((drafts, (), parents))
        return out

    def _top(self, asked: list[tuple[torch.Tensor | None, range, bool]], width: int) -> list[dict[int, object]]:
        """Per row (hidden state, heads wanted, whether its logits are wanted), each wanted
        head's top width tokens, or its logits [vocab]."""
        wanted = [(i, head) for i, (_, heads, _) in enumerate(asked) for head in heads]
        out: list[dict[int, object]] = [{} for _ in asked]
        if not wanted:
            return out
        present = sorted({i for i, _ in wanted})
        hidden = torch.stack([asked[i][0] for i in present])  # [R, hidden]
        size = hidden.shape[-1]
        products = self.heads(hidden).view(len(present), self.num_heads, size)  # every head: one product
        place = {i: j for j, i in enumerate(present)}
        rows, heads = [place[i] for i, _ in wanted], [head for _, head in wanted]
        guessed = residual_block(hidden[rows], products[rows, heads])  # [wanted, hidden]
        logits = self.lm_head(guessed)
        ids = logits.topk(width, dim=-1).indices.tolist()
        for j, ((i, head), top) in enumerate(zip(wanted, ids)):
            out[i][head] = logits[j] if asked[i][2] else top
        return out


def _tree_nodes(tree: TreeShape, chain: list[int], candidates: list[list[int]]) -> tuple[tuple[int, ...], tuple]:
    """The shape's nodes whose rank has a candidate at their depth (a node without one goes,
    with its subtree): their tokens and parents (0 the root), renumbered."""
    choices = []
    for depth in range(tree.depth()):
        first = [chain[depth]] if depth < len(chain) else []
        others = candidates[depth] if depth < len(candidates) else []
        choices.append(first + [t for t in others if t not in first])
    kept: dict[int, int] = {0: 0}  # shape node -> kept node
    node_depth = {0: 0}
    drafts, parents = [], []
    for node, (parent, rank) in enumerate(tree.nodes, start=1):
        depth = node_depth[node] = node_depth[parent] + 1
        if parent not in kept or rank >= len(choices[depth - 1]):
            continue
        drafts.append(choices[depth - 1][rank])
        parents.append(kept[parent])
        kept[node] = len(drafts)
    return tuple(drafts), tuple(parents)
