"""How many of a target's first layers method early_exit should draft with, from measured
agreement: the target continues a short text greedily, and for each count of first layers
the text's tokens are read again through those layers, the final norm and the LM head. The
count whose agreement with the target's own tokens predicts the most tokens per unit of
target time wins (docs/design.md's model: E(alpha, K) / (K c + 1), c the layers' share of a
step, v taken as one step).

A model trained to exit early (LayerSkip) agrees well after a few layers; most do not, and
then no count pays: the verifier says so in its log, serves the best count anyway, and the
adaptive K chooser stops drafting where it does not pay."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.model.llama import decoder_layer, final_logits

log = logging.getLogger(__name__)

PROBE_TOKENS = 48  # the target's greedy tokens the counts are scored on
MAX_K = 4  # the largest K the prediction tries
PROBE_TEXT = "Explain in a few sentences how a bicycle stays upright."


@dataclass(frozen=True)
class ExitChoice:
    layers: int
    agreement: float  # how often those layers' argmax is the target's token
    predicted_speedup: float  # at the best K, verify taken as one step


def choose_layers(runner, tokenizer, max_layers: int | None = None) -> ExitChoice:
    """The count of first layers (1 .. num_layers - 1, at most max_layers) predicted to pay
    best on this target, with its agreement and predicted speedup."""
    prompt = _probe_prompt(tokenizer)
    tokens = _greedy(runner, prompt, PROBE_TOKENS)
    agreement = layer_agreement(runner, prompt + tokens, len(prompt) - 1)
    choices = [
        ExitChoice(layers, rate, _predicted(rate, layers / runner.spec.num_layers))
        for layers, rate in agreement.items()
        if max_layers is None or layers <= max_layers
    ]
    best = max(choices, key=lambda choice: choice.predicted_speedup)
    log.info(
        "early exit drafts with the first %d of %d layers: they agree with the target on %.0f%% of tokens, "
        "predicted %.2fx at best%s",
        best.layers,
        runner.spec.num_layers,
        100 * best.agreement,
        best.predicted_speedup,
        "" if best.predicted_speedup > 1 else " (no count pays on this target: adaptive K will mostly not draft)",
    )
    return best


def _predicted(rate: float, cost: float) -> float:
    """The best E(rate, K) / (K cost + 1) over K = 1 .. MAX_K."""
    best = 0.0
    for k in range(1, MAX_K + 1):
        expected = sum(rate**i for i in range(k + 1))
        best = max(best, expected / (k * cost + 1))
    return best


def _probe_prompt(tokenizer) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": PROBE_TEXT}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(PROBE_TEXT)["input_ids"]


@torch.inference_mode()
def _greedy(runner, prompt: list[int], count: int) -> list[int]:
    """The target's greedy continuation of prompt, count tokens (fewer where the slot ends)."""
    slot = runner.allocate()
    if slot is None:
        return []
    try:
        count = max(0, min(count, runner.max_len - len(prompt) - 1))
        (logits,) = runner.forward([slot], [0], [prompt], [1])
        made = [int(logits[-1].argmax())]
        while len(made) < count:
            (logits,) = runner.forward([slot], [len(prompt) + len(made) - 1], [made[-1:]], [1])
            made.append(int(logits[-1].argmax()))
        return made
    finally:
        runner.release(slot)


@torch.inference_mode()
def layer_agreement(runner, tokens: list[int], start: int) -> dict[int, float]:
    """For each count L of first layers (1 .. num_layers - 1): how often, at the positions from
    start on, the argmax after L layers (through the final norm and the LM head) is the one
    after all of them. The runner's own layers, over a slot of its own, read eagerly."""
    slot = runner.allocate()
    if slot is None:
        return {}
    try:
        layout = runner._layout([slot], [0], [len(tokens)])
        x = runner.embed[torch.tensor(tokens, device=runner.device)].to(runner.dtype)  # [T, hidden]
        cos, sin = runner._rope(layout)
        picks = []
        for index, layer in enumerate(runner.layers):
            x = decoder_layer(x, layer, runner.spec, cos, sin, runner._attend(index, layout))
            picks.append(final_logits(x[start:-1], runner.norm, runner.lm_head, runner.spec.rms_norm_eps).argmax(-1))
        final = picks[-1]
        return {layers + 1: float((pick == final).float().mean()) for layers, pick in enumerate(picks[:-1])}
    finally:
        runner.release(slot)
