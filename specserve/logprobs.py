"""Token log-probabilities under the target (OpenAI's and vLLM's logprobs): the log-softmax
of the target's logits at a token's position, after the request's logits processing
(penalties, biases, masks: specserve/logit_processing.py; none asked, the model's own, which
a log-likelihood evaluation scores) and before temperature, top-k and top-p. A token a mask
rules out has -9999 (vLLM's stand-in for minus infinity, which JSON cannot carry). They are computed in
the verifier from the logits its decision read, for accepted drafts, recovered and bonus
tokens alike, so a token's logprob does not depend on whether a draft proposed it: the
target's logits of a position are the same to the bit for any K, tree or batch
(docs/design.md, "Logprobs")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.v1 import common_pb2

MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
FLOOR = -9999.0  # a masked token's logprob (vLLM's), finite for JSON


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top_token_ids: tuple[int, ...] = ()  # the likeliest first
    top_logprobs: tuple[float, ...] = ()
    rank: int = 1  # by logprob at its position, 1 the likeliest

    def to_proto(self) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(
            logprob=self.logprob, top_token_ids=self.top_token_ids, top_logprobs=self.top_logprobs, rank=self.rank
        )

    @classmethod
    def from_proto(cls, message: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(message.logprob, tuple(message.top_token_ids), tuple(message.top_logprobs), message.rank)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of tokens' log-probability under its row of logits [len(tokens), vocab], and the top
    likeliest tokens' of the row."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=FLOOR, neginf=FLOOR)  # [n, vocab]
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]  # [n]
    ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()
    if top <= 0:
        return [TokenLogprob(value, rank=rank) for value, rank in zip(chosen.tolist(), ranks)]
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return [
        TokenLogprob(value, tuple(row_ids), tuple(row_values), rank)
        for value, row_ids, row_values, rank in zip(chosen.tolist(), ids.tolist(), values.tolist(), ranks)
    ]
