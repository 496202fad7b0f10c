"""`specserve bench`: speculative vs target-only decoding through a running gateway, side by
side in one run, optionally next to transformers' own generate() on the same target.

The machine is shared and noisy, so only ratios measured together count: methods alternate
round by round, every figure comes from the same run. Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_files(path):\n",
    "for i in range(10):\n",
)
TIMING_KEYS = ("draft_seconds", "verify_seconds", "verify_forward_seconds", "verify_kernel_seconds", "wire_seconds")


@dataclass
class Row:
    method: str  # none | draft_model | hf_generate
    k: int
    concurrency: int
    requests: int = 0
    completion_tokens: int = 0
    wall_seconds: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    rounds: int = 0
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMING_KEYS, 0.0))
    batch_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def mean_accepted_length(self) -> float | None:
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else None

    def add_usage(self, usage: dict) -> None:
        self.requests += 1
        self.completion_tokens += usage["completion_tokens"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(self, key, getattr(self, key) + usage["speculation"][key])
        timings = usage.get("timings", {})
        self.rounds += timings.get("rounds", 0)
        for key in TIMING_KEYS:
            self.timings[key] += timings.get(key, 0.0)
        for size, count in timings.get("batch_sizes", {}).items():
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + count

    def summary(self) -> dict:
        per_round = {k: (v / self.rounds * 1000 if self.rounds else None) for k, v in self.timings.items()}
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "mean_accepted_length": self.mean_accepted_length,
                "ms_per_round": per_round}  # fmt: skip


def _request(client: httpx.Client, url: str, prompt: str, row: Row, max_tokens: int, temperature: float) -> dict:
    speculation = {"method": row.method, **({"num_speculative_tokens": row.k} if row.k else {})}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": 0, "return_timings": True,
            "speculation": speculation}  # fmt: skip
    reply = client.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()["usage"]


def run_stack_row(url: str, prompts: list[str], row: Row, max_tokens: int, temperature: float) -> None:
    """One pass over the prompts with row.concurrency clients at once."""
    jobs = [prompts[i % len(prompts)] for i in range(max(len(prompts), row.concurrency))]
    with httpx.Client(limits=httpx.Limits(max_connections=row.concurrency)) as client:
        started = time.perf_counter()
        with ThreadPoolExecutor(row.concurrency) as pool:
            usages = list(pool.map(lambda p: _request(client, url, p, row, max_tokens, temperature), jobs))
        row.wall_seconds += time.perf_counter() - started
    for usage in usages:
        row.add_usage(usage)


class HFGenerate:
    """transformers' generate() of the target alone, in this process."""

    def __init__(self, target_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def run_row(self, prompts: list[str], row: Row, max_tokens: int) -> None:
        for prompt in prompts:
            ids = self.torch.tensor([self.tokenizer(prompt)["input_ids"]])
            started = time.perf_counter()
            with self.torch.inference_mode():
                out = self.model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            row.wall_seconds += time.perf_counter() - started
            row.requests += 1
            row.completion_tokens += out.shape[1] - ids.shape[1]


def bench(args: argparse.Namespace) -> list[Row]:
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    rows = [Row("none", 0, c) for c in args.concurrency]
    rows += [Row("draft_model", k, c) for c in args.concurrency for k in args.k]
    hf = HFGenerate(args.hf_target) if args.hf_target else None
    if hf:
        rows.append(Row("hf_generate", 0, 1))
    with httpx.Client() as client:  # warm-up: first calls pay for lazy initialisation
        _request(client, args.url, prompts[0], Row("draft_model", args.k[0], 1), 8, args.temperature)
    for repeat in range(args.repeats):
        for index, row in enumerate(rows):  # interleaved: load elsewhere hits every row alike
            print(
                f"\rrepeat {repeat + 1}/{args.repeats}, row {index + 1}/{len(rows)}",
                end="",
                file=sys.stderr,
                flush=True,
            )
            if row.method == "hf_generate":
                hf.run_row(prompts, row, args.max_tokens)
            else:
                run_stack_row(args.url, prompts, row, args.max_tokens, args.temperature)
    print(file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    baseline = {row.concurrency: row.tokens_per_s for row in rows if row.method == "none"}
    single = baseline.get(1) or next(iter(baseline.values()))
    lines = [
        "| method | K | clients | tokens/s | vs none (same clients) | vs none x1 | mean accepted length "
        "| ms/round draft | verify (forward, kernel) | wire | verifier batch sizes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        summary = row.summary()["ms_per_round"]
        same = baseline.get(row.concurrency)
        mal = f"{row.mean_accepted_length:.2f}" if row.mean_accepted_length else "-"
        fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
        verify = f"{fmt(summary['verify_seconds'])} ({fmt(summary['verify_forward_seconds'])}, {fmt(summary['verify_kernel_seconds'])})"
        sizes = ", ".join(f"{k}:{v}" for k, v in sorted(row.batch_sizes.items(), key=lambda kv: int(kv[0]))) or "-"
        lines.append(
            f"| {row.method} | {row.k or '-'} | {row.concurrency} | {row.tokens_per_s:.1f} "
            f"| {row.tokens_per_s / same:.2f}x | {row.tokens_per_s / single:.2f}x | {mal} | {fmt(summary['draft_seconds'])} "
            f"| {verify} | {fmt(summary['wire_seconds'])} | {sizes} |"
            if same
            else f"| {row.method} | - | {row.concurrency} | {row.tokens_per_s:.1f} | - | {row.tokens_per_s / single:.2f}x | - | - | - | - | - |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway URL")
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="draft lengths to compare")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="concurrent clients per row")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few code stubs")
    parser.add_argument("--hf-target", help="also time transformers' generate() of this target in-process")
    parser.add_argument("--output", default="bench-results/bench.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    rows = bench(args)
    print(table(rows))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": vars(args), "rows": [row.summary() for row in rows]}, indent=2))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
