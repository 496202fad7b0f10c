"""EAGLE rounds: the verifier drafts a session's next round with an EAGLE head
(specserve/methods/eagle.py) from the hidden states its forwards left.

Each session keeps the head's keys and values of its entries (one per position whose
hidden state the verifier gave, from the prompt's last on) and the hidden states not yet
read. A round first reads those (the tokens the last round kept: one entry each, in one
product), whose last guess drafts the first token; each later draft is one more entry, the
guess before it and its token, whose keys the round then forgets. Where the hidden states
given do not follow the entries (a token tree's round, which the state does not see, or a
drafting that failed and reset it), the entries start again where they start.

The drafts are drawn from the head's distribution over its vocabulary, processed as the
request's sampling processes the target's (temperature, top-k, top-p) and truncated to the
support size: their q is what they were drawn from, so the verifier's rule is exact. The
request's logits processing and grammar are the verifier's to apply (drafts against them
are rejected there); chains only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.methods.eagle import EagleHead, attend
from specserve.model.linear import Linear, int8_products_work
from specserve.protocol import SparseDistribution
from specserve.sampling import processed_probs, sample_sparse, truncate_to_support


@dataclass
class EagleState:
    """A session's entries: keys and values [n, kv_heads, d] from position start on, and the
    hidden states [hidden] of the positions after them, not yet read."""

    start: int = -1
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    pending: list[torch.Tensor] = field(default_factory=list)

    @property
    def entries(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def reset(self) -> None:
        """Forgets every entry: the next hidden states start them again."""
        self.start, self.keys, self.values, self.pending = -1, None, None, []

    def observe(self, position: int, hidden: torch.Tensor) -> None:
        """The hidden states [m, hidden] of positions position .. position + m - 1."""
        if self.start < 0 or position != self.start + self.entries + len(self.pending):
            self.reset()
            self.start = position
        self.pending.extend(hidden)


class _Packed(nn.Module):
    """A head's matrix as the runner multiplies a draft's: int8 rows where the CPU multiplies
    bfloat16 natively (each draft step reads the matrices afresh after a verify has evicted
    them, and int8 rows are the fewest bytes), else prepacked in dtype."""

    def __init__(self, linear: nn.Linear, int8: bool, dtype: torch.dtype) -> None:
        super().__init__()
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        self.product = Linear(linear.weight.detach().to(dtype), bias, row_invariant=False, int8=int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


class EagleDrafting:
    def __init__(self, head: EagleHead, embed: torch.Tensor, support_size: int, dtype: torch.dtype = torch.bfloat16):
        """embed: the target's input embeddings [vocab, hidden] (the head drafts on their
        device). dtype: the matrices' (int8 rows multiplied in bfloat16 where the CPU
        multiplies bfloat16 natively); on a CPU the rest of a step (norms, attention over the
        session's keys) runs in float32, several times faster there than in bfloat16 for one
        query (docs/design.md, "EAGLE heads")."""
        self.device = embed.device
        cpu = self.device.type == "cpu"
        int8 = dtype == torch.bfloat16 and cpu and int8_products_work()
        self.dtype = torch.float32 if cpu else dtype  # the activations' and the keys'
        self.head = head.to(device=self.device, dtype=self.dtype)
        for name in ("fc", "qkv", "o", "gate_up", "down"):
            setattr(self.head, name, _Packed(getattr(self.head, name), int8, dtype))
        self.lm_rows = Linear(self.head.lm_rows.detach().to(dtype), row_invariant=False, int8=int8)
        self.vocabulary = self.head.vocabulary
        self.embed = embed
        self.support_size = support_size

    @torch.inference_mode()
    def propose(self, rows: list[tuple[EagleState, list[int], int, object]]) -> list[tuple[tuple, tuple]]:
        """Per row (its state, verified tokens, k, sampling): (drafts, their q; () greedy)."""
        return [self._chain(state, verified, k, sampling) for state, verified, k, sampling in rows]

    def _chain(self, state: EagleState, verified: list[int], k: int, sampling) -> tuple[tuple, tuple]:
        guess = self._read(state, verified)
        if guess is None:  # no hidden state of the position before the last token
            return (), ()
        drafts, distributions = [], []
        keys, values = state.keys, state.values
        for i in range(k):
            token, distribution = self._draw(guess, sampling, len(verified) + i)
            drafts.append(token)
            if distribution is not None:
                distributions.append(distribution)
            if i + 1 == k:
                break
            position = torch.tensor([len(verified) - 1 + i], device=self.device)
            x, q, key, value = self.head.entries(guess[None], self.embed[token][None].to(self.dtype), position)
            keys, values = torch.cat([keys, key]), torch.cat([values, value])
            guess = self.head.finish(x, attend(q[None], keys[None], values[None])[0])[0]  # every entry
        return tuple(drafts), tuple(distributions)

    def _read(self, state: EagleState, verified: list[int]) -> torch.Tensor | None:
        """Reads the pending hidden states into entries; the last entry's guess [hidden] (of
        the hidden state of the last verified token), or None where they do not reach it."""
        first, count = state.start + state.entries, len(state.pending)
        if state.start < 0 or count == 0 or first + count != len(verified) - 1:
            return None
        feature = torch.stack(state.pending).to(self.dtype)
        tokens = torch.tensor(verified[first + 1 : first + 1 + count], device=self.device)
        positions = torch.arange(first, first + count, device=self.device)
        x, q, key, value = self.head.entries(feature, self.embed[tokens].to(self.dtype), positions)
        keys = key if state.keys is None else torch.cat([state.keys, key])
        values = value if state.values is None else torch.cat([state.values, value])
        seen = positions[:, None] - state.start >= torch.arange(keys.shape[0], device=self.device)[None]
        guessed = self.head.finish(x, attend(q[None], keys[None], values[None], seen)[0])
        state.keys, state.values, state.pending = keys, values, []
        return guessed[-1]

    def _draw(self, guess: torch.Tensor, sampling, position: int) -> tuple[int, SparseDistribution | None]:
        """A draft from the head's logits over its vocabulary: the argmax, or drawn from them
        processed as the request's sampling processes the target's (over the vocabulary
        alone: the same as over the target's with every other token at -inf)."""
        logits = self.lm_rows(guess[None])[0].float()
        if sampling.is_greedy:
            return int(self.vocabulary[logits.argmax()]), None
        rows, q = truncate_to_support(processed_probs(logits[None], sampling)[0], self.support_size)
        ids = self.vocabulary[rows]
        distribution = SparseDistribution(tuple(ids.tolist()), tuple(q.tolist()))
        return sample_sparse(ids, q, sampling.seed, position), distribution
