"""Sampling math shared by the draft and the verifier: the target's processed distribution,
the draft's sparse distribution, and randomness keyed by (seed, position).

Keyed randomness is what makes a seeded request reproducible and batch-independent
(docs/design.md, invariant 4): every random number used for sequence position t comes from a
generator seeded by a hash of (seed, t, stream), never from a shared global stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.errors import require
from specserve.logit_processing import LogitProcessing
from specserve.v1 import common_pb2

# Independent random streams per position: the verifier's accept test and token draws must
# be independent of the draft's own draws at the same position.
VERIFY_STREAM = 0
DRAFT_STREAM = 1
SIBLING_STREAM = 16  # + r: a token tree's r-th draw at a position (r >= 1)
VERIFY_SIBLING_STREAM = 8  # the accept tests of a token tree's second and later children at a position

_MASK64 = (1 << 64) - 1

# Sampling parameters travel as 32-bit floats: these bounds keep them normal numbers whose
# effect is what was asked (a temperature of 1e-40 would divide the logits by zero).
TEMPERATURE_RANGE = (1e-6, 1e4)
MIN_TOP_P = 1e-6


def sampling_problem(temperature: float, top_p: float, top_k: int, seed: int) -> tuple[str, str] | None:
    """What is wrong with these sampling parameters, as (message, parameter), or None: the
    one check of them, which the gateway answers with a 400 naming the parameter and the
    services with INVALID_ARGUMENT."""
    low, high = TEMPERATURE_RANGE
    if not (temperature == 0 or low <= temperature <= high):  # NaN fails both
        return f"temperature must be 0 (greedy) or lie in [{low:g}, {high:g}]", "temperature"
    if not MIN_TOP_P <= top_p <= 1:
        return f"top_p must lie in [{MIN_TOP_P:g}, 1]", "top_p"
    if top_k < 0:
        return "top_k must be >= 0 (0 keeps every token)", "top_k"
    if not 0 <= seed <= _MASK64:
        return "seed must lie in [0, 2**64)", "seed"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """What the user asked for; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: bool = False  # return each token's logprob (specserve/logprobs.py)
    top_logprobs: int = 0  # and the likeliest tokens' beside it, at most 20
    min_p: float = 0.0  # after temperature: tokens less likely than min_p times the likeliest go
    ignore_eos: bool = False  # go on past end-of-sequence tokens, to max_tokens
    processing: LogitProcessing = LogitProcessing()  # penalties, biases, masks: before all of it

    def __post_init__(self) -> None:
        problem = sampling_problem(self.temperature, self.top_p, self.top_k, self.seed)
        require(problem is None, problem[0] if problem else "")
        require(0 <= self.top_logprobs <= 20, "top_logprobs must lie in 0..20")  # specserve.logprobs.MAX_TOP_LOGPROBS
        require(0 <= self.min_p <= 1, "min_p must lie in [0, 1]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_proto(cls, message: common_pb2.SamplingParams) -> SamplingParams:
        # On the wire 0 means unset for top_p (proto3 default), i.e. keep every token.
        top_p = message.top_p if message.top_p != 0 else 1.0
        return cls(
            temperature=message.temperature,
            top_p=top_p,
            top_k=message.top_k,
            seed=message.seed,
            logprobs=message.logprobs,
            top_logprobs=message.top_logprobs,
            min_p=message.min_p,
            processing=LogitProcessing(
                message.presence_penalty,
                message.frequency_penalty,
                repetition_penalty=message.repetition_penalty or 1.0,
                logit_bias=tuple(sorted(message.logit_bias.items())),
                min_tokens=message.min_tokens,
                stop_token_ids=tuple(message.stop_token_ids),
                allowed_token_ids=tuple(message.allowed_token_ids),
                bad_words=tuple(tuple(words.token_ids) for words in message.bad_words),
            ),
            ignore_eos=message.ignore_eos,
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            min_p=self.min_p,
            presence_penalty=self.processing.presence_penalty,
            frequency_penalty=self.processing.frequency_penalty,
            repetition_penalty=self.processing.repetition_penalty,
            logit_bias=dict(self.processing.logit_bias),
            min_tokens=self.processing.min_tokens,
            stop_token_ids=self.processing.stop_token_ids,
            allowed_token_ids=self.processing.allowed_token_ids,
            ignore_eos=self.ignore_eos,
            bad_words=[common_pb2.TokenSequence(token_ids=words) for words in self.processing.bad_words],
        )


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then min-p, top-k and top-p, as in
    transformers' generate() and vLLM (logits already processed: specserve/logit_processing.py).
    logits [n, vocab] -> probs [n, vocab] float32."""
    scores = logits.float() / params.temperature
    if params.min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        scores = scores.masked_fill(~nucleus(scores.softmax(-1), params.top_p), float("-inf"))
    return scores.softmax(-1)


# The likeliest tokens looked at first for a nucleus: a partial selection of them, widened
# fourfold while their mass falls short of top_p, costs far less than sorting the vocabulary.
NUCLEUS_FIRST = 64


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's tokens [n, vocab] bool: those whose likelier tokens have less than top_p of
    the mass between them (the likeliest always), found among the NUCLEUS_FIRST likeliest,
    or four times as many, until those hold top_p."""
    vocab = probs.shape[-1]
    size = min(NUCLEUS_FIRST, vocab)
    while True:
        top, ids = torch.topk(probs, size, dim=-1)  # sorted, likeliest first
        cumulative = top.cumsum(-1)
        if size == vocab or bool((cumulative[..., -1] >= top_p).all()):
            break
        size = min(4 * size, vocab)
    keep = (cumulative - top) < top_p  # the mass of the likelier ones
    keep[..., 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, ids, keep)


def truncate_to_support(probs: torch.Tensor, support_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's sparse distribution: probs [vocab] restricted to its support_size most
    likely tokens (fewer if fewer have mass) and renormalised -> (ids [s] int64, probs [s] float32)."""
    top = torch.topk(probs, min(support_size, probs.shape[-1]))
    keep = top.values > 0
    ids, kept = top.indices[keep], top.values[keep]
    return ids, kept / kept.sum()


def mix_seed(seed: int, position: int, stream: int) -> int:
    """splitmix64 over (seed, position, stream): decorrelated generator seeds per position."""
    value = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) >> 1  # manual_seed takes 63 bits here


def position_generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(mix_seed(seed, position, stream))
    return generator


def exponential_noise(generator: torch.Generator, size: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise for the exponential race, as -log(1 - U): five times faster on a CPU than
    torch's exponential_ (a vocabulary's worth is drawn each sampled round). Clamped away
    from 0 so that 0 / noise stays 0."""
    noise = torch.rand(size, generator=generator, device=device).neg_().log1p_().neg_()
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def verify_uniforms(seed: int, first_position: int, count: int) -> torch.Tensor:
    """The accept tests' uniforms [count] of a verify row whose p_1 is at sequence position
    first_position (verify_noise's, without its noise): on the CPU the noise is drawn at the
    one position that needs it (draw_noise)."""
    cpu = torch.device("cpu")
    uniforms = torch.zeros(count)
    for i in range(count):
        uniforms[i] = torch.rand(1, generator=position_generator(seed, first_position + i, VERIFY_STREAM, cpu))[0]
    return uniforms


def draw_noise(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [vocab] of the draw at a sequence position: verify_noise's row there."""
    generator = position_generator(seed, position, VERIFY_STREAM, device)
    torch.rand(1, generator=generator, device=device)  # the accept test's uniform comes first
    return exponential_noise(generator, vocab, device)


def verify_noise(
    seed: int, first_position: int, num_draft: int, k_max: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random numbers of one verify row whose p_1 is at sequence position first_position:
    uniforms [k_max] for the accept tests (verify_uniforms) and Exp(1) noise [k_max + 1,
    vocab] for the recovered or bonus draw (draw_noise). Positions past num_draft + 1 are
    padding."""
    uniforms = torch.zeros(k_max)
    uniforms[:num_draft] = verify_uniforms(seed, first_position, num_draft)
    noise = torch.ones(k_max + 1, vocab, device=device)
    for i in range(num_draft + 1):
        noise[i] = draw_noise(seed, first_position + i, vocab, device)
    return uniforms.to(device), noise


def tree_verify_noise(
    seed: int, first_position: int, depth_max: int, siblings_max: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random numbers of one token tree's verify whose root's children are at sequence
    position first_position: uniforms [depth_max + 1, siblings_max] (tree_verify_uniforms)
    and Exp(1) noise [depth_max + 1, vocab] (the draw where the walk stops, draw_noise's)."""
    noise = torch.stack([draw_noise(seed, first_position + depth, vocab, device) for depth in range(depth_max + 1)])
    return tree_verify_uniforms(seed, first_position, depth_max, siblings_max).to(device), noise


def tree_verify_uniforms(seed: int, first_position: int, depth_max: int, siblings_max: int) -> torch.Tensor:
    """The accept tests [depth_max + 1, siblings_max] of a token tree's verify: the r-th child
    tried at each depth. The first child's uniform at each depth is verify_noise's at that
    position, so a tree that is a chain decides as the chain does; the other children's come
    from a stream of their own, so that noise is drawn only at the depth where the walk stops."""
    cpu = torch.device("cpu")
    uniforms = torch.zeros(depth_max + 1, siblings_max)
    uniforms[:, 0] = verify_uniforms(seed, first_position, depth_max + 1)
    for depth in range(depth_max + 1):
        if siblings_max > 1:
            siblings = position_generator(seed, first_position + depth, VERIFY_SIBLING_STREAM, cpu)
            uniforms[depth, 1:] = torch.rand(siblings_max - 1, generator=siblings)
    return uniforms


def sample_sparse(ids: torch.Tensor, probs: torch.Tensor, seed: int, position: int, draw: int = 0) -> int:
    """Draw one token of a sparse distribution with the draft's keyed randomness; draw numbers
    independent draws at one position (a token tree's siblings), 0 a chain's."""
    generator = position_generator(seed, position, DRAFT_STREAM if draw == 0 else SIBLING_STREAM + draw, probs.device)
    noise = exponential_noise(generator, probs.shape[0], probs.device)
    return int(ids[torch.argmax(probs / noise)])


def draft_noise(seed: int, first_position: int, count: int, size: int, device: torch.device) -> torch.Tensor:
    """The Exp(1) noise [count, size] of a chain's draws at count positions from
    first_position on: sample_sparse's (a draw from fewer than size tokens reads a prefix
    of its row, which is what a generator of its own draws)."""
    generators = [position_generator(seed, first_position + i, DRAFT_STREAM, device) for i in range(count)]
    return torch.stack([exponential_noise(generator, size, device) for generator in generators])


def sparse_draws(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft's draws from logits [n, vocab] at temperature and top_p (0-dim tensors; a
    top_p of 1 passed as infinity), as processed_probs, truncate_to_support and sample_sparse
    draw them, in ops a compiled graph holds: the support is the noise's width S, the
    likeliest S tokens, of which the nucleus's are kept and renormalised (tokens outside
    the S likeliest are outside the support either way). Returns the tokens [n], the
    support's ids [n, S] and q [n, S], 0 where a token is not kept."""
    top, ids = torch.topk(torch.softmax(logits.float() / temperature, -1), noise.shape[-1], dim=-1)  # likeliest first
    q = top.masked_fill((top.cumsum(-1) - top) >= top_p, 0)  # the mass of the likelier ones: the first stays
    q = q / q.sum(-1, keepdim=True)
    return ids.gather(-1, (q / noise).argmax(-1, keepdim=True))[:, 0], ids, q
