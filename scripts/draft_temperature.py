"""How often a sampled draft would be kept at each drafting temperature: for the demo pair on
third-party code (teacher-forced), the acceptance sum_x min(p(x), q(x)) of the target's p at
the request's temperature T against the draft's q at T * f, cut to its 32 likeliest tokens
as the drafter cuts it, for several f; and a greedy draft's, p(argmax q). Prints a table.

    python scripts/draft_temperature.py [--files 12] [--tokens 256]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.paths import DEMO_DRAFT, DEMO_TARGET
from specserve.tools.workloads import third_party_sources

FACTORS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.2)
SUPPORT = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    target = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(DEMO_DRAFT), dtype=torch.float32).eval()
    sources = third_party_sources()
    texts = [text for _, text in sources][:: max(1, len(sources) // args.files)][: args.files]
    target_logits, draft_logits = [], []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, 100 : 100 + args.tokens]
            if ids.shape[1] < 2:
                continue
            target_logits.append(target(ids).logits[0].float())
            draft_logits.append(draft(ids).logits[0].float())
    p_logits, q_logits = torch.cat(target_logits), torch.cat(draft_logits)
    print(f"{p_logits.shape[0]} positions of {len(target_logits)} files")
    print("| T | greedy draft | " + " | ".join(f"f = {f}" for f in FACTORS) + " |")
    print("|---|---|" + "---|" * len(FACTORS))
    for temperature in (0.8, 1.0):
        p = (p_logits / temperature).softmax(-1)
        cells = [f"{p.gather(1, q_logits.argmax(-1, keepdim=True)).mean():.3f}"]
        for factor in FACTORS:
            q = (q_logits / (temperature * factor)).softmax(-1)
            top = q.topk(SUPPORT, -1)
            cut = torch.zeros_like(q).scatter_(1, top.indices, top.values)
            cut = cut / cut.sum(-1, keepdim=True)
            cells.append(f"{torch.minimum(p, cut).sum(-1).mean():.3f}")
        print(f"| {temperature} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
