"""What a drafter is asked and answers (specserve/drafting.py): its options, a session's
draft state, one round's job and its proposal."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.methods.ngram import CopyScore
from specserve.methods.trees import TreeShape
from specserve.model.backends import KVSequence
from specserve.model.loading import LoadedModel
from specserve.protocol import SparseDistribution
from specserve.sampling import SamplingParams


@dataclass(frozen=True)
class DraftOptions:
    """What a drafter needs to know of its host service."""

    vocab_size: int
    max_context_length: int
    max_sessions: int
    max_speculative_tokens: int = 16
    support_size: int = 32  # draft tokens are drawn from the draft's top support_size tokens, renormalised
    ngram_max: int = 4  # longest suffix the ngram drafter looks up
    copy_min_ngram: int = 2  # a model draft copies where a suffix this long repeats (0: never)
    process_logits: bool = False  # a request's penalties, biases and masks shape the draft's logits too
    max_batched_tokens: int = 2048

    @classmethod
    def of(cls, config, loaded: LoadedModel) -> DraftOptions:
        """From a service's config (the draft service's or the verifier's: they name these
        fields alike), for the vocabulary and context window of loaded."""
        return cls(
            vocab_size=loaded.vocab_size,
            max_context_length=loaded.max_context_length,
            max_sessions=config.max_sessions,
            max_speculative_tokens=config.max_speculative_tokens,
            support_size=config.support_size,
            ngram_max=config.ngram_max,
            copy_min_ngram=config.copy_min_ngram,
            process_logits=config.process_draft_logits,
            max_batched_tokens=config.max_batched_tokens,
        )


@dataclass
class DraftSession:
    """Owned by one stream; only the batcher's worker thread touches its state."""

    session_id: str
    method: str
    sequence: KVSequence | None  # None for the context methods (ngram, suffix): there is no cache
    verified: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache
    copy_score: CopyScore = field(default_factory=CopyScore)  # whether its drafts start with a copy
    context: object | None = None  # a context method's state (its ContextProposer's: suffix's counts)
    prompt_length: int = 0  # verified tokens that are the prompt (0: the first job's); the rest is output
    eos_token_ids: tuple[int, ...] = ()  # the model's: masked under min_tokens


@dataclass(frozen=True)
class DraftJob:
    session: DraftSession
    tokens: tuple[int, ...]  # verified tokens from num_verified - len(tokens) on
    num_verified: int
    num_speculative_tokens: int
    sampling: SamplingParams
    min_draft_probability: float = 0.0
    want_bonus_guess: bool = False
    tree: TreeShape | None = None  # draft a token tree of this shape (specserve/methods/tree_drafting.py)
    grammar: object | None = None  # GrammarState (specserve/grammar.py): the drafts' q are masked by it


@dataclass(frozen=True)
class Proposal:
    num_verified: int
    draft_token_ids: tuple[int, ...]
    draft_distributions: tuple[SparseDistribution, ...]
    bonus_guess: int = -1
    batch_size: int = 1
    batch_started_ns: int = 0  # wall-clock (time.time_ns) start and end of the batch
    batch_ended_ns: int = 0
    draft_parents: tuple[int, ...] = ()  # a tree's: each draft's parent (0 the root); () a chain
