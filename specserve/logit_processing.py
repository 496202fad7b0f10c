"""A request's logits processing (OpenAI's and vLLM's penalties, biases and masks), applied
to the target's logits at every position of a round from the tokens before that position,
the round's drafts included, before the decision reads them (docs/design.md, "Logits
processing"). The decision then accepts a draft by the processed target distribution, so
speculative output follows it exactly, as target-only output does: greedy, the argmax of
the processed logits; sampled, the rejection rule against p processed, with the draft's q as
it was drawn.

Order, vLLM's: allowed_token_ids, min_tokens and logit_bias, then the repetition, frequency
and presence penalties; temperature, min_p, top-k and top-p come after
(specserve.sampling.processed_probs). Presence and frequency count the output's tokens;
repetition the prompt's and the output's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.errors import require

MAX_BIAS = 100.0  # OpenAI's range of a logit_bias value


@dataclass(frozen=True)
class LogitProcessing:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until the output has as many
    stop_token_ids: tuple[int, ...] = ()  # masked with end-of-sequence under min_tokens
    allowed_token_ids: tuple[int, ...] = ()  # (): every token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output may not complete

    def __post_init__(self) -> None:
        require(-2 <= self.presence_penalty <= 2, "presence_penalty must lie in [-2, 2]")
        require(-2 <= self.frequency_penalty <= 2, "frequency_penalty must lie in [-2, 2]")
        require(0 < self.repetition_penalty <= 10, "repetition_penalty must lie in (0, 10]")
        require(all(-MAX_BIAS <= b <= MAX_BIAS for _, b in self.logit_bias), "logit_bias values lie in [-100, 100]")
        require(self.min_tokens >= 0, "min_tokens must be >= 0")

    @property
    def active(self) -> bool:
        return self != NEUTRAL  # read for every row of every round

    def token_ids(self) -> list[int]:
        """Every token id it names (each must lie in the vocabulary)."""
        named = [t for t, _ in self.logit_bias] + list(self.stop_token_ids) + list(self.allowed_token_ids)
        return named + [t for words in self.bad_words for t in words]

    def after(self, tokens: list[int], prompt_length: int, eos: tuple[int, ...]):
        """A function (logits [vocab], added) -> logits processed at the position after tokens
        (the first prompt_length of them the prompt) and then added (a round's drafts before
        the position): how a drafter shapes its own logits as the verifier does the target's."""
        prompt, output = tokens[:prompt_length], tokens[prompt_length:]
        return lambda logits, added: self.apply(logits[None], prompt, output, [list(added)], eos)[0]

    def apply(
        self, logits: torch.Tensor, prompt: list[int], output: list[int], added: list[list[int]], eos: tuple[int, ...]
    ) -> torch.Tensor:
        """logits [n, vocab] processed, row r after output + added[r] (the output: the tokens
        after the prompt); float32, on the CPU (a round's few rows). A row the masks would leave
        without a token (allowed_token_ids against bad_words or min_tokens) keeps its logits."""
        raw = logits.float().cpu()
        scores = raw.clone()
        n, vocab = scores.shape
        if self.allowed_token_ids:
            mask = torch.full((vocab,), float("-inf"))
            mask[list(self.allowed_token_ids)] = 0.0
            scores += mask
        if self.min_tokens:
            short = [r for r in range(n) if len(output) + len(added[r]) < self.min_tokens]
            ended = [t for t in (*eos, *self.stop_token_ids) if t < vocab]
            if short and ended:
                before = scores.clone()
                scores[torch.tensor(short)[:, None], torch.tensor(ended)[None, :]] = float("-inf")
                dead = torch.isinf(scores).all(-1)  # allowed_token_ids left only the ends: they stay
                scores[dead] = before[dead]
        if self.logit_bias:
            ids, bias = zip(*self.logit_bias)
            scores[:, list(ids)] += torch.tensor(bias)
        for r in range(n) if self.bad_words else ():
            before = (output + added[r])[-max(len(words) for words in self.bad_words) :]
            for words in self.bad_words:
                if len(words) == 1 or tuple(before[len(before) - len(words) + 1 :]) == words[:-1]:
                    scores[r, words[-1]] = float("-inf")
        dead = torch.isinf(scores).all(-1)
        scores[dead] = raw[dead]
        if not (self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1):
            return scores
        counts = (
            torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float().expand(n, vocab).clone()
        )
        for r, tokens in enumerate(added):
            if tokens:
                counts[r].index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))
        if self.repetition_penalty != 1:
            seen = counts > 0
            if prompt:
                seen[:, torch.tensor(prompt)] = True
            penalised = torch.where(scores > 0, scores / self.repetition_penalty, scores * self.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        return scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()


NEUTRAL = LogitProcessing()  # asks for nothing
