"""What tracing costs: two stacks side by side, one exporting every span over OTLP (to a
receiver in this process) and one with tracing off, requests alternating between them.

    python scripts/tracing_overhead.py [--target DIR --draft DIR] [--rounds 6] [--sample-ratio 1.0] [--control]

Prints tokens/s of each and their ratio, and the CPU time the services spent per token,
and writes bench-results/tracing_overhead.json.
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


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) used so far by a process and its descendants still running."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    except OSError:
        pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(DEMO_TARGET))
    parser.add_argument("--draft", default=str(DEMO_DRAFT))
    parser.add_argument("--rounds", type=int, default=6, help="passes over the prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-ratio", type=float, default=1.0, help="the traced stack's trace sample ratio")
    parser.add_argument("--control", action="store_true", help="trace neither stack: the comparison's noise floor")
    args = parser.parse_args()
    collector = SpanCollector(f"127.0.0.1:{free()}").start()
    tracing = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        "SPECSERVE_GATEWAY_TRACE_SAMPLE_RATIO": str(args.sample_ratio),
    }
    traced = start(args.target, args.draft, {} if args.control else tracing)
    plain = start(args.target, args.draft, {})
    prompts = code_completion_prompts(8)
    totals = {"traced": [0, 0.0], "off": [0, 0.0]}
    cpu_at_start = {name: cpu_seconds(process.pid) for name, (process, _) in (("traced", traced), ("off", plain))}
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
        cpu = {name: cpu_seconds(process.pid) - cpu_at_start[name]
               for name, (process, _) in (("traced", traced), ("off", plain))}  # fmt: skip
    finally:
        for process, _ in (traced, plain):
            process.terminate()
            process.wait(timeout=60)
        collector.stop()
    rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    result = {
        "sample_ratio": args.sample_ratio,
        "control": args.control,
        "tokens_per_s": rates,
        "traced_over_off": rates["traced"] / rates["off"],
        # CPU time per token of the three services: less noisy than wall time on a shared machine
        "cpu_ms_per_token": {name: 1e3 * cpu[name] / totals[name][0] for name in totals},
        "spans_received": len(collector.snapshot()),
    }
    print(f"tracing on: {rates['traced']:.1f} tok/s, off: {rates['off']:.1f} tok/s, "
          f"on/off = {result['traced_over_off']:.3f}; CPU ms per token on {result['cpu_ms_per_token']['traced']:.2f}, "
          f"off {result['cpu_ms_per_token']['off']:.2f}; {result['spans_received']} spans received")  # fmt: skip
    Path("bench-results").mkdir(exist_ok=True)
    name = "tracing_overhead_control.json" if args.control else "tracing_overhead.json"
    Path("bench-results", name).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
