"""A request's plan and its rounds as the gateway sees them (docs/design.md, "The round"):
what the API asked for (GenerationPlan), each round's tokens and timings (Round), the
proposal of a draft service (Proposal) and how long target-only stretches last."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.grammar import Grammar
from specserve.methods.trees import TreeShape
from specserve.sampling import SamplingParams
from specserve.speculation import Speculation
from specserve.v1 import draft_pb2, verify_pb2


@dataclass(frozen=True)
class GenerationPlan:
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    method: str  # draft_model | early_exit | ngram | suffix | medusa | lookahead | none
    num_speculative_tokens: int  # K, where an adaptive choice starts
    adaptive: bool = False  # K per round from the session's measured costs (specserve.speculation)
    min_draft_probability: float = 0.0
    k_bounds: tuple[int, int] = (0, 8)  # the adaptive choice's range (0: it may stop drafting)
    pipeline: bool = False  # draft round r + 1 while round r is verified (a draft service's rounds)
    yields_to_load: bool = True  # decodes target-only while crowded() (a seeded sampled request does not)
    local: bool = False  # the verifier drafts for this method itself: all rounds in one Decode stream
    tree: TreeShape | None = None  # each round a token tree of this shape (adaptive: where it pays)
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (echo, prompt_logprobs), this many top ones
    tenant: str = ""  # who the request is for (a hash of its API key): what method suffix may share
    isolated: bool = False  # method suffix learns from no other request (a seeded sampled one)
    lookahead: tuple[int, int, int] = (0, 0, 0)  # method lookahead's W, N, G (0: the verifier's default)
    grammar: Grammar | None = None  # what the output follows (structured outputs), masked in the verifier

    @property
    def speculation(self) -> Speculation | None:
        if self.method == "none":
            return None
        return Speculation(
            self.method,
            self.num_speculative_tokens,
            adaptive=self.adaptive,
            k_bounds=self.k_bounds,
            min_draft_probability=self.min_draft_probability,
            tree=self.tree,
            tenant=self.tenant,
            isolated=self.isolated,
            lookahead=self.lookahead,
        )


@dataclass(frozen=True)
class Round:
    """One round as the gateway saw it. A round drafted in the verifier (colocated) has no
    draft call: its draft seconds are the verifier's drafting, as seen and as spent."""

    new_tokens: list[int]
    k: int  # draft tokens verified (0: a target-only round)
    num_accepted: int
    batch_size: int
    draft_seconds: float
    draft_server_seconds: float
    verify_seconds: float
    verify_server_seconds: float
    verify_forward_seconds: float = 0.0
    verify_kernel_seconds: float = 0.0
    verify_mask_seconds: float = 0.0  # the grammar's masks (structured outputs), alongside the forward
    wire_bytes: int = 0
    pipelined: bool = False  # drafted during the previous round's verification
    tree: bool = False  # its drafts were a token tree (k its nodes, num_accepted the depth kept)
    logprobs: tuple = ()  # its tokens' TokenLogprob messages, where the sampling asks

    @property
    def wire_seconds(self) -> float:
        return (self.draft_seconds - self.draft_server_seconds) + (self.verify_seconds - self.verify_server_seconds)

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds


@dataclass(frozen=True)
class Proposal:
    """A draft service's answer for one round: no drafts (a target-only round) when it failed."""

    drafts: list[int]
    distributions: list
    bonus_guess: int  # the draft's guess at the bonus token (-1: none asked, or not all drafted)
    seconds: float  # the call, as seen here
    server_seconds: float  # the service's own drafting
    wire_bytes: int  # both ways
    response: draft_pb2.DraftResponse | None = None
    parents: list[int] | None = None  # a token tree's: each draft's parent (0 the root)


# Target-only stretches of a speculative request (a draft service that failed, or too many
# requests for speculation to pay) decode this many tokens before drafting is tried again,
# twice as many after each stretch in a row (up to the maximum): every new Decode call waits
# for a batch to join, which cost ~8% of tokens/s at 16-token stretches (4 and 16 clients).
TARGET_ONLY_STRETCH = (16, 256)


def decoded_round(response: verify_pb2.DecodeResponse, seconds: float, wire_bytes: int) -> Round:
    """A Decode stream's round; seconds: since the previous one arrived. Its drafting (when the
    verifier drafted it) counts as draft time, the rest as verify time."""
    draft = response.draft_seconds
    return Round(
        new_tokens=[*response.accepted_token_ids, response.token_id],
        k=response.num_draft_tokens,
        num_accepted=len(response.accepted_token_ids),
        batch_size=response.batch_size,
        draft_seconds=draft,
        draft_server_seconds=draft,
        verify_seconds=max(0.0, seconds - draft),
        verify_server_seconds=max(0.0, response.server_seconds - draft),
        verify_forward_seconds=response.forward_seconds,
        verify_kernel_seconds=response.kernel_seconds,
        verify_mask_seconds=response.mask_seconds,
        wire_bytes=wire_bytes,
        tree=response.tree,
        logprobs=tuple(response.logprobs),
    )


def round_attributes(round_: Round) -> dict:
    return {
        "specserve.k": round_.k,
        "specserve.tree": round_.tree,
        "specserve.num_accepted": round_.num_accepted,
        "specserve.batch_size": round_.batch_size,
        "specserve.draft_seconds": round_.draft_seconds,
        "specserve.verify_seconds": round_.verify_seconds,
        "specserve.wire_seconds": round_.wire_seconds,
    }
