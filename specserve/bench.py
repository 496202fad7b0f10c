"""`specserve bench`: speculative vs target-only decoding through a running gateway, side by
side in one run (the machine is shared and noisy: only ratios measured together count).

Prints a Markdown table and writes JSON. Methods alternate request by request so that a
burst of load elsewhere hits both alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_files(path):\n",
    "for i in range(10):\n",
)


@dataclass
class Row:
    method: str
    k: int
    requests: int
    completion_tokens: int
    seconds: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted_length(self) -> float | None:
        if not self.num_drafts:
            return None
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def run_one(
    client: httpx.Client, url: str, prompt: str, method: str, k: int, max_tokens: int, temperature: float
) -> tuple[float, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": 0,
            "speculation": {"method": method, "num_speculative_tokens": k}}  # fmt: skip
    started = time.perf_counter()
    reply = client.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - started, reply.json()["usage"]


def bench(url: str, prompts: list[str], ks: list[int], max_tokens: int, temperature: float, repeats: int) -> list[Row]:
    configs = [("none", 1)] + [("draft_model", k) for k in ks]
    rows = {config: Row(config[0], config[1], 0, 0, 0.0, 0, 0, 0) for config in configs}
    with httpx.Client() as client:
        run_one(client, url, prompts[0], "draft_model", ks[0], 8, temperature)  # warm-up
        total = repeats * len(prompts) * len(configs)
        done = 0
        for _ in range(repeats):
            for prompt in prompts:
                for config in configs:  # interleaved: noise hits every method alike
                    seconds, usage = run_one(client, url, prompt, *config, max_tokens, temperature)
                    row = rows[config]
                    row.requests += 1
                    row.seconds += seconds
                    row.completion_tokens += usage["completion_tokens"]
                    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                        setattr(row, key, getattr(row, key) + usage["speculation"][key])
                    done += 1
                    print(f"\r{done}/{total} requests", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    return list(rows.values())


def table(rows: list[Row]) -> str:
    baseline = rows[0].tokens_per_s
    lines = ["| method | K | tokens/s | speedup vs none | mean accepted length | acceptance rate |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        mal = f"{row.mean_accepted_length:.2f}" if row.mean_accepted_length else "-"
        rate = f"{row.acceptance_rate:.2f}" if row.acceptance_rate is not None else "-"
        k = row.k if row.method != "none" else "-"
        lines.append(
            f"| {row.method} | {k} | {row.tokens_per_s:.1f} | {row.tokens_per_s / baseline:.2f}x | {mal} | {rate} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway URL")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="draft lengths to compare")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few code stubs")
    parser.add_argument("--output", default="bench-results/bench.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    rows = bench(
        args.url, args.prompt or list(DEFAULT_PROMPTS), args.k, args.max_tokens, args.temperature, args.repeats
    )
    print(table(rows))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    records = [{**asdict(r), "tokens_per_s": r.tokens_per_s, "mean_accepted_length": r.mean_accepted_length,
                "acceptance_rate": r.acceptance_rate} for r in rows]  # fmt: skip
    output.write_text(json.dumps({"args": vars(args), "rows": records}, indent=2))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
