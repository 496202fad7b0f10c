"""Scoring a prompt: a prefill that asks for its prompt tokens' logprobs (echo,
prompt_logprobs; a log-likelihood request) runs alone in chunks (a plain prefill's, of
max_batched_tokens; SCORE_CHUNK_TOKENS in float32), and each chunk's logits become the
logprobs of the tokens they predict at once: a long prompt never holds its [prompt, vocab]
logits. The logprobs are the model's own (raw: no logits
processing, as vLLM's prompt logprobs).

Where the target's matrices are 16-bit on a CPU, the scoring multiplies a float32 copy of them
(the backend's scores_precisely): a log-likelihood then agrees with the checkpoint's float32
forward to about 1e-5 nats, where bfloat16 products are off by up to 0.08. The cache is then
written again as a plain prefill writes it, so what the request generates after its prompt is
what it would be without the scoring."""

from __future__ import annotations

from specserve.logprobs import token_logprobs
from specserve.model.backends import Backend, ForwardRow

SCORE_CHUNK_TOKENS = 512  # at most [512, vocab] logits at once, scoring in float32


def score_prompt(backend: Backend, row, max_batched_tokens: int) -> bool:
    """Fills row.prompt_logprobs (each prompt token's from the second on, with row.prompt_top
    likeliest beside it); whether the row's plain prefill forward is still to run (the scoring
    multiplied in float32: the cache is rewritten), else its logits are set as a prefill's.
    Without float32 the chunks are a plain prefill's (forward_in_budget's: max_batched_tokens
    each), so the cache and the last logits are what a prefill without scoring makes."""
    feed, sequence, precise = row.feed, row.session.sequence, backend.scores_precisely
    start = sequence.length
    chunk = max(1, min(max_batched_tokens, SCORE_CHUNK_TOKENS) if precise else max_batched_tokens)
    for begin in range(0, len(feed), chunk):
        part = feed[begin : begin + chunk]
        logits = backend.forward_scoring(ForwardRow(sequence, part, len(part)))
        scored = logits if begin + len(part) < len(feed) else logits[:-1]  # the last: the decision's
        row.prompt_logprobs += token_logprobs(scored, feed[begin + 1 : begin + 1 + len(scored)], row.prompt_top)
    if precise:
        sequence.truncate(start)
        return True
    row.logits, row.argmax = logits[-1:], None
    if sequence.hidden is not None:
        sequence.hidden = sequence.hidden[-1:]
    return False
