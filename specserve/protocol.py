"""Domain types that cross the wire between services, with their proto conversions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.errors import require
from specserve.model.loading import LoadedModel
from specserve.v1 import common_pb2

# Sums of float32 probabilities of a normalised support land within ~1e-6 of 1; anything
# further off was not normalised and cannot be the distribution a token was drawn from.
NORMALISATION_TOLERANCE = 1e-3


@dataclass(frozen=True)
class SparseDistribution:
    """q over a sparse support: token_ids[i] has probability probs[i], all else 0."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]

    @classmethod
    def from_proto(
        cls, message: common_pb2.SparseDistribution, vocab_size: int, max_support: int
    ) -> SparseDistribution:
        ids, probs = tuple(message.token_ids), tuple(message.probs)
        require(len(ids) == len(probs), f"distribution has {len(ids)} token_ids but {len(probs)} probs")
        require(0 < len(ids) <= max_support, f"distribution support must have 1..{max_support} tokens, got {len(ids)}")
        require(all(0 <= t < vocab_size for t in ids), f"distribution token ids must lie in [0, {vocab_size})")
        require(len(set(ids)) == len(ids), "distribution token ids must be distinct")
        require(all(math.isfinite(p) and p >= 0 for p in probs), "distribution probs must be finite and >= 0")
        total = math.fsum(probs)
        require(abs(total - 1) <= NORMALISATION_TOLERANCE, f"distribution probs must sum to 1, got {total:.6g}")
        return cls(ids, probs)

    def to_proto(self) -> common_pb2.SparseDistribution:
        return common_pb2.SparseDistribution(token_ids=self.token_ids, probs=self.probs)

    def prob_of(self, token_id: int) -> float:
        for token, prob in zip(self.token_ids, self.probs):
            if token == token_id:
                return prob
        return 0.0


def check_token_ids(token_ids: list[int] | tuple[int, ...], vocab_size: int, what: str) -> None:
    require(all(0 <= t < vocab_size for t in token_ids), f"{what} must lie in [0, {vocab_size})")


def model_info(
    loaded: LoadedModel, max_speculative_tokens: int, local_methods: tuple[str, ...] = ()
) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_name=loaded.name,
        vocab_size=loaded.vocab_size,
        max_context_length=loaded.max_context_length,
        eos_token_ids=loaded.eos_token_ids,
        max_speculative_tokens=max_speculative_tokens,
        tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        device=str(loaded.device),
        local_methods=local_methods,
    )
