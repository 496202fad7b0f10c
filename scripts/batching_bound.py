"""The most tokens/s N concurrent speculative streams could reach on this machine's cores:
the compiled forwards of both models timed in tight loops, one thread each, as if every
round of the N streams met in one verify and one set of draft steps, and nothing else (no
gateway, gRPC, sampling or idle time) took a core.

    python scripts/batching_bound.py [--target DIR --draft DIR] [--streams 16] [--k 4]
                                     [--mean-accepted-length 3.69] [--prompt-tokens 300]
                                     [--max-tokens 64] [--cores 2]

Per request it counts both prefills and max_tokens / mean accepted length rounds, each a
share of one verify of K + 1 tokens per stream and of the draft's K + 1 steps (a catch-up
of two tokens, then K - 1 of one). Prints the table and writes
bench-results/batching_bound.json. Compare the bound with `specserve bench`'s one-stream
row of the same workload (--mean-accepted-length is its E column).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specserve.model.runner import LlamaRunner
from specserve.paths import DEMO_DRAFT, DEMO_TARGET


def median_seconds(call, repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def forward_costs(directory: str, row_invariant: bool, streams: int, k: int, prompt_tokens: int) -> dict:
    """Seconds of a prefill and of forwards of `streams` rows of K + 1, 2 and 1 tokens each."""
    runner = LlamaRunner(
        directory,
        torch.device("cpu"),
        torch.float32,
        streams,
        prompt_tokens + 64,
        row_invariant=row_invariant,
        compile_steps=True,
    )
    steps = runner.compiled_steps
    if steps is not None and steps.thread is not None:
        steps.thread.join()
    generator = torch.Generator().manual_seed(0)
    vocab = runner.spec.vocab_size
    slots = [runner.allocate() for _ in range(streams)]
    prompts = [torch.randint(1, vocab, (prompt_tokens,), generator=generator).tolist() for _ in slots]
    costs = {"prefill": median_seconds(lambda: runner.forward(slots[:1], [0], prompts[:1], [1]), 5)}
    for slot, prompt in zip(slots, prompts):
        runner.forward([slot], [0], [prompt], [1])
    starts = [prompt_tokens] * streams
    for n in sorted({k + 1, 2, 1}):
        rows, logits = [list(range(5, 5 + n))] * streams, [n] * streams
        costs[f"rows of {n}"] = median_seconds(lambda: runner.forward(slots, starts, rows, logits), 30)  # noqa: B023
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(DEMO_TARGET))
    parser.add_argument("--draft", default=str(DEMO_DRAFT))
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--mean-accepted-length", type=float, default=3.69, help="tokens per round (bench's E)")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--output", default="bench-results/batching_bound.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = forward_costs(args.target, True, args.streams, args.k, args.prompt_tokens)
    draft = forward_costs(args.draft, False, args.streams, args.k, args.prompt_tokens)
    rounds = args.max_tokens / args.mean_accepted_length
    per_round = (
        target[f"rows of {args.k + 1}"] + draft["rows of 2"] + (args.k - 1) * draft["rows of 1"]
    ) / args.streams
    per_request = {"prefills": target["prefill"] + draft["prefill"], "rounds": rounds * per_round}
    bound = args.cores * args.max_tokens / sum(per_request.values())
    print("| forward (one thread) | target ms | draft ms |\n|---|---|---|")
    for name in target:
        label = f"prefill of {args.prompt_tokens}" if name == "prefill" else f"{args.streams} {name}"
        print(f"| {label} | {target[name] * 1e3:.2f} | {draft[name] * 1e3:.2f} |")
    print(
        f"\ncore-ms per request: prefills {per_request['prefills'] * 1e3:.1f}, rounds {per_request['rounds'] * 1e3:.1f}"
    )
    print(f"bound on {args.cores} cores: {bound:.0f} tok/s over {args.streams} streams")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "args": vars(args),
        "target_seconds": target,
        "draft_seconds": draft,
        "per_request_seconds": per_request,
        "bound_tokens_per_s": bound,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
