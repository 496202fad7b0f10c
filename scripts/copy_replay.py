"""Greedy rounds replayed offline: how many tokens a K-token round keeps when a model's drafts
start with a copy of the context always, never, or as each session's CopyScore decides
(specserve/methods/ngram.py; docs/design.md, "A copy before the draft").

    python scripts/copy_replay.py [--target DIR] [--draft DIR] [--k 4] [--code 24] [--edit 12] [--chat 12]

For each held-out prompt (the bench's workloads), the target's greedy continuation of 64
tokens; the draft's greedy guesses, teacher-forced on it, are what a greedy draft proposes
while its drafts are kept. Rounds are replayed over the continuation as the drafter makes
them: the copy that ngram_drafts offers (a suffix of at least 2 tokens), then the model's
guesses. Prints tokens a round per workload and setting, and writes
bench-results/copy_replay.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.methods.ngram import CopyScore, ngram_drafts
from specserve.paths import DEMO_DRAFT, DEMO_TARGET
from specserve.tools import workloads

SETTINGS = ("model alone", "always copy", "copy score")


def replay(sequence: list[int], start: int, guesses: list[int], k: int, setting: str) -> tuple[int, int]:
    """(tokens, rounds) of greedy rounds from start to the end of sequence; guesses[i] is the
    draft's guess of sequence[i + 1]."""
    score, position, tokens, rounds = CopyScore(), start, 0, 0
    while position < len(sequence):
        score.judge(sequence)
        offered = ngram_drafts(sequence[:position], k, 4, min_n=2) if setting != "model alone" else []
        copied = offered if setting == "always copy" or (setting == "copy score" and score.prefers_copy()) else []
        room = min(k, len(sequence) - position)
        drafts = [copied[i] if i < len(copied) else guesses[position + i - 1] for i in range(room)]
        kept = next((i for i, (a, b) in enumerate(zip(drafts, sequence[position:])) if a != b), len(drafts))
        score.proposed(position, drafts, offered, len(copied))
        step = min(kept + 1, len(sequence) - position)
        position, tokens, rounds = position + step, tokens + step, rounds + 1
    return tokens, rounds


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(DEMO_TARGET))
    parser.add_argument("--draft", default=str(DEMO_DRAFT))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--code", type=int, default=24, help="code prompts")
    parser.add_argument("--edit", type=int, default=12, help="edit prompts")
    parser.add_argument("--chat", type=int, default=12, help="chat prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default="bench-results/copy_replay.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = {
        "code": [tokenizer(p)["input_ids"] for p in workloads.code_completion_prompts(args.code)],
        "edit": [tokenizer(p)["input_ids"] for p in workloads.edit_prompts(args.edit)],
        "chat": [
            list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for m in workloads.chat_prompts(args.chat)
        ],
    }
    results = {}
    print(f"| workload | {' | '.join(SETTINGS)} |\n|---|{'---|' * len(SETTINGS)}")
    for name, rows in prompts.items():
        totals = {setting: [0, 0] for setting in SETTINGS}
        for ids in rows:
            sequence = target.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)[0]
            guesses = draft(sequence[None]).logits[0].argmax(-1).tolist()
            for setting in SETTINGS:
                tokens, rounds = replay(sequence.tolist(), len(ids), guesses, args.k, setting)
                totals[setting][0] += tokens
                totals[setting][1] += rounds
        results[name] = {setting: tokens / rounds for setting, (tokens, rounds) in totals.items()}
        print(f"| {name} ({len(rows)} prompts) | " + " | ".join(f"{results[name][s]:.2f}" for s in SETTINGS) + " |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "tokens_per_round": results}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
