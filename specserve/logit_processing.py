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
from specserve_kernels.penalties import apply_penalties

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
        after the prompt); float32, on the logits' device (the penalties by the kernel of
        specserve_kernels/penalties.py). A row the masks would leave without a token
        (allowed_token_ids against bad_words or min_tokens) keeps its logits. Ids past the
        logits' vocabulary (a draft's output layer may be narrower than its target's, which
        checked them) are left out."""
        raw = logits.float()
        scores = raw.clone()
        n, vocab = scores.shape
        device = scores.device
        if self.allowed_token_ids:
            mask = torch.full((vocab,), float("-inf"), device=device)
            mask[torch.tensor([t for t in self.allowed_token_ids if t < vocab], device=device, dtype=torch.long)] = 0
            scores += mask
        if self.min_tokens:
            short = [r for r in range(n) if len(output) + len(added[r]) < self.min_tokens]
            ended = [t for t in (*eos, *self.stop_token_ids) if t < vocab]
            if short and ended:
                before = scores.clone()
                scores[torch.tensor(short, device=device)[:, None], torch.tensor(ended, device=device)[None, :]] = (
                    float("-inf")
                )
                dead = torch.isinf(scores).all(-1)  # allowed_token_ids left only the ends: they stay
                scores[dead] = before[dead]
        biased = [(t, b) for t, b in self.logit_bias if t < vocab]
        if biased:
            ids, bias = zip(*biased)
            scores[:, torch.tensor(ids, device=device)] += torch.tensor(bias, device=device)
        for r in range(n) if self.bad_words else ():
            before = (output + added[r])[-max(len(words) for words in self.bad_words) :]
            for words in self.bad_words:
                if words[-1] >= vocab:
                    continue
                if len(words) == 1 or tuple(before[len(before) - len(words) + 1 :]) == words[:-1]:
                    scores[r, words[-1]] = float("-inf")
        dead = torch.isinf(scores).all(-1)
        scores[dead] = raw[dead]
        if not (self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1):
            return scores
        entries = (t.to(device) for t in self._entries(prompt, output, added, vocab))
        return apply_penalties(scores, *entries, self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    def _entries(self, prompt: list[int], output: list[int], added: list[list[int]], vocab: int) -> tuple:
        """The penalties' entries (rows, tokens, counts, seen): per row, each token its output
        holds (with the row's added tokens), and the prompt's where repetition applies."""
        n, inside = len(added), lambda tokens: [t for t in tokens if t < vocab]
        made = torch.tensor(inside(output), dtype=torch.long)
        counts = torch.bincount(made, minlength=vocab).float().expand(n, vocab).clone()
        for r, tokens in enumerate(map(inside, added)):
            if tokens:
                counts[r].index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))
        seen = counts > 0
        if prompt and self.repetition_penalty != 1:
            seen[:, torch.tensor(inside(prompt), dtype=torch.long)] = True
        rows, tokens = seen.nonzero(as_tuple=True)
        return rows, tokens, counts[rows, tokens], seen[rows, tokens].to(torch.uint8)


NEUTRAL = LogitProcessing()  # asks for nothing
