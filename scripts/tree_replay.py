"""Tokens per round that draft chains and token trees of the same node count would give,
replayed offline: the target's greedy continuation of held-out code prompts, and at each
round start the draft's greedy chain and its alternatives (the draft's second or third
choice at a depth, continued greedily). A round keeps the longest path that matches the
continuation, then the target's own next token.

    python scripts/tree_replay.py [--prompts 16] [--max-tokens 64]

Prints the table and writes bench-results/tree_replay.json. Greedy only; the tokens per
round a tree would give through the stack, not its cost (see docs/design.md, "Token trees").
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.paths import DEMO_DRAFT, DEMO_TARGET, REPO_ROOT
from specserve.tools.workloads import code_completion_prompts

# A shape: the main chain's length, and alternatives as (depth they branch at, the draft's
# choice there: 1 second, 2 third, their length).
SHAPES = {
    "chain K=4": (4, []),
    "chain K=8": (8, []),
    "two chains of 4 from the first and second choice": (4, [(0, 1, 4)]),
    "chain 5, second choice at depth 1 for 3": (5, [(0, 1, 3)]),
    "chain 4, second choices at depths 1 and 2 for 2": (4, [(0, 1, 2), (1, 1, 2)]),
    "chain 5, second choices at depth 1 for 2 and depth 2 for 1": (5, [(0, 1, 2), (1, 1, 1)]),
    "chain 4, second and third choices at depth 1 for 2": (4, [(0, 1, 2), (0, 2, 2)]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    target = AutoModelForCausalLM.from_pretrained(DEMO_TARGET).eval()
    draft = AutoModelForCausalLM.from_pretrained(DEMO_DRAFT).eval()

    @torch.no_grad()
    def greedy(model, ids: list[int], n: int) -> list[int]:
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        return out[0, len(ids) :].tolist()

    @torch.no_grad()
    def choice(ids: list[int], rank: int) -> int:
        return draft(torch.tensor([ids])).logits[0, -1].topk(rank + 1).indices[rank].item()

    def paths(ids: list[int], shape) -> list[list[int]]:
        main_length, alternatives = shape
        main = greedy(draft, ids, main_length)
        found = [main]
        for depth, rank, length in alternatives:
            prefix = main[:depth]
            token = choice(ids + prefix, rank)
            found.append(prefix + [token] + (greedy(draft, ids + prefix + [token], length - 1) if length > 1 else []))
        return found

    totals = {name: [0, 0] for name in SHAPES}  # tokens, rounds
    for prompt in code_completion_prompts(args.prompts):
        ids = tokenizer(prompt)["input_ids"]
        continuation = greedy(target, ids, args.max_tokens)
        for name, shape in SHAPES.items():
            position = 0
            while position < len(continuation):
                kept = 0
                for path in paths(ids + continuation[:position], shape):
                    n = 0
                    while n < len(path) and position + n < len(continuation) and path[n] == continuation[position + n]:
                        n += 1
                    kept = max(kept, n)
                position += kept + 1
                totals[name][0] += kept + 1
                totals[name][1] += 1
    rows = [
        {
            "shape": name,
            "nodes": shape[0] + sum(length for _, _, length in shape[1]),
            "tokens_per_round": totals[name][0] / totals[name][1],
        }
        for name, shape in SHAPES.items()
    ]
    print("| shape | nodes | tokens per round |\n|---|---|---|")
    for row in rows:
        print(f"| {row['shape']} | {row['nodes']} | {row['tokens_per_round']:.3f} |")
    out = REPO_ROOT / "bench-results" / "tree_replay.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens, "rows": rows}, indent=2))
    print(f"wrote {out.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
