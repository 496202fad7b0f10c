"""What the verifier's decision costs on this CPU: `decide()` over rows like a round's, greedy and
sampled, by vocabulary, batch, K and top-p, one torch thread. Prints a table and writes JSON.

    python scripts/decision_cost.py [--output decision_cost.json] [--repeats 20]

Run it at two commits (a `git worktree` of the older) to compare; the rows' logits and drafts
are seeded, so both runs decide the same rows.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from specserve.protocol import SparseDistribution
from specserve.sampling import SamplingParams, processed_probs, truncate_to_support
from verify_service.decisions import decide


def rows(vocab: int, batch: int, k: int, sampling: SamplingParams, generator: torch.Generator) -> list:
    """batch verify rows of k drafts drawn from the target's own distribution (q its top 32)."""
    out = []
    for b in range(batch):
        logits = torch.randn(k + 1, vocab, generator=generator) * 6
        drafts, distributions = [], []
        if not sampling.is_greedy:
            p = processed_probs(logits, sampling)
            for i in range(k):
                ids, probs = truncate_to_support(p[i], 32)
                drafts.append(int(ids[torch.multinomial(probs, 1, generator=generator)]))
                distributions.append(SparseDistribution(tuple(ids.tolist()), tuple(probs.tolist())))
        else:
            drafts = logits[:k].argmax(-1).tolist()
        out.append(SimpleNamespace(logits=logits, sampling=sampling, drafts=tuple(drafts),
                                   distributions=tuple(distributions), first_position=100 + b, parents=None,
                                   argmax=None, batch_size=1))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="decision_cost.json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    cases = [
        ("greedy", SamplingParams(temperature=0)),
        ("T=0.8", SamplingParams(temperature=0.8, seed=1)),
        ("T=0.8 top_p=0.95", SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
    ]
    results = []
    print("| vocabulary | rows | K | sampling | ms per decide() |\n|---|---|---|---|---|")
    for vocab in (8192, 49152):
        for batch in (1, 16):
            for name, sampling in cases:
                for k in (0, 4):
                    batch_rows = rows(vocab, batch, k, sampling, generator)
                    decide(batch_rows, torch.device("cpu"))  # the first call pays for lazy set-up
                    started = time.perf_counter()
                    for _ in range(args.repeats):
                        decide(batch_rows, torch.device("cpu"))
                    ms = (time.perf_counter() - started) / args.repeats * 1000
                    results.append({"vocab": vocab, "rows": batch, "k": k, "sampling": name, "ms": ms})
                    print(f"| {vocab} | {batch} | {k} | {name} | {ms:.2f} |")
    with open(args.output, "w") as file:
        json.dump(results, file, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
