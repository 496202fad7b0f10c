"""Two running stacks compared, interleaved prompt by prompt: every request goes to both,
back to back, in an order that alternates by prompt, so drift in the machine's speed falls
on both alike. For a change that should leave speed level (a refactor): start the stack of
each checkout on ports of its own, then

    python scripts/compare_stacks.py --before http://127.0.0.1:8200 --after http://127.0.0.1:8300

Prints tok/s per method and temperature and the geometric mean of after/before over the
prompts; greedy outputs of the two must be equal (a difference is printed). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from specserve.tools.workloads import code_completion_prompts

METHODS = {
    "none": {"method": "none"},
    "draft_model K=4": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
    "draft_model adaptive": {"method": "draft_model"},
    "ngram K=4": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "medusa K=3": {"method": "medusa", "num_speculative_tokens": 3, "adaptive": False},
}


def tokens_per_second(client: httpx.Client, url: str, body: dict) -> tuple[float, str]:
    started = time.perf_counter()
    reply = client.post(f"{url}/v1/completions", json=body)
    reply.raise_for_status()
    answer = reply.json()
    return answer["usage"]["completion_tokens"] / (time.perf_counter() - started), answer["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the first stack's gateway URL")
    parser.add_argument("--after", required=True, help="the second stack's gateway URL")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--prompts", type=int, default=8, help="held-out code prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default="compare-stacks.json")
    args = parser.parse_args()
    stacks = {"before": args.before, "after": args.after}
    prompts = code_completion_prompts(args.prompts)
    speeds = {(s, m, t): [] for s in stacks for m in args.methods for t in args.temperatures}
    client = httpx.Client(timeout=300)
    for url in stacks.values():  # warm-up: each method's first round compiles or loads something
        for method in args.methods:
            body = {"prompt": prompts[0], "max_tokens": 16, "temperature": 0, "speculation": METHODS[method]}
            client.post(f"{url}/v1/completions", json=body)
    for i, prompt in enumerate(prompts):
        for temperature in args.temperatures:
            for method in args.methods:
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": temperature,
                        "seed": 1000 + i, "ignore_eos": True, "speculation": METHODS[method]}  # fmt: skip
                texts = {}
                for name in list(stacks) if i % 2 == 0 else list(reversed(stacks)):
                    speed, texts[name] = tokens_per_second(client, stacks[name], body)
                    speeds[(name, method, temperature)].append(speed)
                if temperature == 0 and texts["before"] != texts["after"]:
                    print(f"greedy outputs differ: {method}, prompt {i}")
    report = []
    print(f"{'method':22} {'T':>4} {'before tok/s':>13} {'after tok/s':>12} {'after/before':>13}")
    for method in args.methods:
        for temperature in args.temperatures:
            before, after = speeds[("before", method, temperature)], speeds[("after", method, temperature)]
            ratio = statistics.geometric_mean([a / b for a, b in zip(after, before)])
            row = {"method": method, "temperature": temperature, "before_tok_s": statistics.mean(before),
                   "after_tok_s": statistics.mean(after), "after_over_before": ratio}  # fmt: skip
            report.append(row)
            speeds_text = f"{row['before_tok_s']:13.1f} {row['after_tok_s']:12.1f}"
            print(f"{method:22} {temperature:4.1f} {speeds_text} {ratio:13.3f}")
    with open(args.output, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
