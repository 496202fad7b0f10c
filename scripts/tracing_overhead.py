"""What tracing costs: two stacks side by side, one exporting every span over OTLP (to a
receiver in this process) and one with tracing off, requests alternating between them.

    python scripts/tracing_overhead.py [--target DIR --draft DIR] [--rounds 6]

Prints tokens/s of each and their ratio, and writes bench-results/tracing_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specserve.paths import DEMO_DRAFT, DEMO_TARGET
from specserve.trace_report import SpanCollector
from specserve.workloads import code_completion_prompts


def free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(target: str, draft: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free()
    command = [sys.executable, "-m", "specserve.cli", "up", "--port", str(port), "--draft-port", str(free()),
               "--verify-port", str(free()), "--draft-metrics-port", str(free()), "--verify-metrics-port", str(free()),
               "--target", target, "--draft", draft]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("a stack did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(DEMO_TARGET))
    parser.add_argument("--draft", default=str(DEMO_DRAFT))
    parser.add_argument("--rounds", type=int, default=6, help="passes over the prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    collector = SpanCollector(f"127.0.0.1:{free()}").start()
    traced = start(args.target, args.draft, {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}"})
    plain = start(args.target, args.draft, {})
    prompts = code_completion_prompts(8)
    totals = {"traced": [0, 0.0], "off": [0, 0.0]}
    try:
        with httpx.Client(timeout=300) as client:
            for _ in range(args.rounds):
                for prompt in prompts:
                    for name, url in (("traced", traced[1]), ("off", plain[1])):
                        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                        started = time.perf_counter()
                        usage = client.post(f"{url}/v1/completions", json=body).json()["usage"]
                        totals[name][0] += usage["completion_tokens"]
                        totals[name][1] += time.perf_counter() - started
    finally:
        for process, _ in (traced, plain):
            process.terminate()
            process.wait(timeout=60)
        collector.stop()
    rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    result = {
        "tokens_per_s": rates,
        "traced_over_off": rates["traced"] / rates["off"],
        "spans_received": len(collector.snapshot()),
    }
    print(f"tracing on: {rates['traced']:.1f} tok/s, off: {rates['off']:.1f} tok/s, "
          f"on/off = {result['traced_over_off']:.3f}; {result['spans_received']} spans received")  # fmt: skip
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/tracing_overhead.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
