"""What a verify of N tokens costs the demo target on this machine: a chain of N tokens (one
sequence's row) against a token tree of N nodes (the tree forward: one row per node, each
node stored on every branch slot it lies on, the branch slots synced first), timed in
turns, size after size, through the compiled steps a verifier uses.

    python scripts/verify_cost.py [--target DIR] [--context 300] [--repeats 40]

Prints milliseconds per verify and the ratio to a verify of one token (a target-only step),
and writes bench-results/verify_cost.json. The trees are the bench's: a main chain with the
draft's second choices at depths 1 and 2 (see docs/design.md, "Token trees").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specserve.methods.trees import TreeShape, branches, depths
from specserve.model.backends import ForwardRow, RunnerBackend, TreeNodes
from specserve.model.runner import LlamaRunner
from specserve.paths import DEMO_TARGET

# Tree of N nodes, the root (the last verified token) among them: paths of draft ranks.
TREES = {
    5: [[0], [0, 0], [0, 0, 0], [1]],
    9: [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [1], [1, 0], [0, 1]],
    13: [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
    + [[0, 0, 0, 0, 0, 0, 0, 0], [1], [1, 0], [0, 1], [0, 0, 1]],
    16: [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
    + [[0, 0, 0, 0, 0, 0, 0, 0], [1], [1, 0], [1, 0, 0], [0, 1], [0, 1, 0], [0, 0, 1], [2]],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(DEMO_TARGET))
    parser.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--output", default="bench-results/verify_cost.json")
    args = parser.parse_args()

    runner = LlamaRunner(args.target, torch.device("cpu"), torch.float32, 8, args.context + 32, compile_steps=True)
    if runner.compiled_steps is not None and runner.compiled_steps.thread is not None:
        runner.compiled_steps.thread.join()
    backend = RunnerBackend(runner)
    prompt = torch.randint(1, runner.spec.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    sequence = backend.open()
    backend.forward_with_argmax([ForwardRow(sequence, prompt.tolist(), 1)])

    def chain(n: int) -> None:
        backend.forward_with_argmax([ForwardRow(sequence, list(range(5, 5 + n)), n)])
        sequence.truncate(args.context)

    def tree(n: int) -> None:
        parents = (-1, *TreeShape.from_paths(TREES[n]).parents)
        on = branches(parents)
        backend.reserve_branches(sequence, len({b for node in on for b in node}))
        backend.forward_trees([TreeNodes(sequence, args.context, list(range(5, 5 + n)), depths(parents), on)])
        sequence.branch_synced = [args.context - 1] * len(sequence.branch_slots)  # one token to sync, as a round

    rows = [("chain", n, lambda n=n: chain(n)) for n in (1, 2, 5, 9, 13, 16)]
    rows += [("tree", n, lambda n=n: tree(n)) for n in TREES]
    times: dict[tuple[str, int], list[float]] = {(kind, n): [] for kind, n, _ in rows}
    for _ in range(3):
        for _, _, call in rows:
            call()
    for _ in range(args.repeats):  # in turns, so drift falls on every row alike
        for kind, n, call in rows:
            started = time.perf_counter()
            call()
            times[(kind, n)].append(time.perf_counter() - started)
    median = {key: sorted(values)[len(values) // 2] * 1e3 for key, values in times.items()}
    one = median[("chain", 1)]
    print("| verify | tokens | ms | target steps |\n|---|---|---|---|")
    for (kind, n), ms in median.items():
        print(f"| {kind} | {n} | {ms:.2f} | {ms / one:.2f} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            [{"verify": kind, "tokens": n, "ms": ms, "target_steps": ms / one} for (kind, n), ms in median.items()]
        )
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
