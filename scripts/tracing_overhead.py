"""What tracing costs: two stacks side by side, one exporting every span over OTLP (to a
receiver in this process) and one with tracing off, requests alternating between them.

    python scripts/tracing_overhead.py [--target DIR --draft DIR] [--rounds 6] [--sample-ratio 1.0]
                                       [--control | --uninstrumented]

Prints tokens/s of each and their ratio, and the CPU time the services spent per token,
and writes bench-results/tracing_overhead*.json. --control traces neither stack (the
comparison's noise floor); --uninstrumented compares tracing off with a stack whose
tracing calls are all replaced by bare no-ops (what tracing off costs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specserve.paths import DEMO_DRAFT, DEMO_TARGET
from specserve.tools.bench import wait_for_compiled_steps
from specserve.tools.trace_report import SpanCollector
from specserve.tools.workloads import code_completion_prompts

# Loaded by every process of the uninstrumented stack before the services import
# specserve.serving.telemetry: each tracing entry point becomes a bare no-op.
NO_TRACING = """
import contextlib
from opentelemetry.trace import INVALID_SPAN
import specserve.serving.telemetry as telemetry


class _Tracer:
    def start_as_current_span(self, *args, **kwargs):
        return contextlib.nullcontext(INVALID_SPAN)

    def start_span(self, *args, **kwargs):
        return INVALID_SPAN


_tracer = _Tracer()
telemetry.tracer = lambda: _tracer
telemetry.tracing_enabled = lambda: False
telemetry.span = lambda *args, **kwargs: contextlib.nullcontext(INVALID_SPAN)
telemetry.start_span = lambda *args, **kwargs: INVALID_SPAN
telemetry.rpc_span = lambda *args, **kwargs: contextlib.nullcontext(INVALID_SPAN)
telemetry.set_rpc_status = lambda span, code: None
telemetry.metadata_with_trace_context = lambda: ()
telemetry.inject = lambda carrier: carrier
telemetry.extract = lambda carrier: None
telemetry.record_span = lambda *args, **kwargs: None
"""


def free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(target: str, draft: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port, verify_metrics = free(), free()
    command = [
        sys.executable,
        "-m",
        "specserve.cli",
        "up",
        "--port",
        str(port),
        "--draft-port",
        str(free()),
        "--verify-port",
        str(free()),
        "--draft-metrics-port",
        str(free()),
        "--verify-metrics-port",
        str(verify_metrics),
        "--target",
        target,
        "--draft",
        draft,
    ]
    process = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                wait_for_compiled_steps(verify_metrics, time.monotonic() + 300)
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
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--control", action="store_true", help="trace neither stack: the comparison's noise floor")
    mode.add_argument("--uninstrumented", action="store_true", help="tracing off against tracing calls made no-ops")
    args = parser.parse_args()
    collector = SpanCollector(f"127.0.0.1:{free()}").start()
    tracing = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        "SPECSERVE_GATEWAY_TRACE_SAMPLE_RATIO": str(args.sample_ratio),
    }
    with tempfile.TemporaryDirectory() as stub_dir:
        Path(stub_dir, "sitecustomize.py").write_text(NO_TRACING)
        no_tracing = {"PYTHONPATH": os.pathsep.join(filter(None, [stub_dir, os.environ.get("PYTHONPATH")]))}
        if args.uninstrumented:
            stacks = {"off": {}, "uninstrumented": no_tracing}
        else:
            stacks = {"traced": {} if args.control else tracing, "off": {}}
        first, second = stacks
        result = compare(args, {name: start(args.target, args.draft, env) for name, env in stacks.items()}, collector)
    ratio = result["tokens_per_s"][first] / result["tokens_per_s"][second]
    result.update(
        sample_ratio=args.sample_ratio,
        control=args.control,
        uninstrumented=args.uninstrumented,
        ratio=f"{first}/{second}",
        **{f"{first}_over_{second}": ratio},
    )
    rates, cpu = result["tokens_per_s"], result["cpu_ms_per_token"]
    print(
        f"{first}: {rates[first]:.1f} tok/s, {second}: {rates[second]:.1f} tok/s, {first}/{second} = {ratio:.3f}; "
        f"CPU ms per token {first} {cpu[first]:.2f}, {second} {cpu[second]:.2f}; "
        f"{result['spans_received']} spans received"
    )
    Path("bench-results").mkdir(exist_ok=True)
    suffix = "_control" if args.control else "_uninstrumented" if args.uninstrumented else ""
    Path("bench-results", f"tracing_overhead{suffix}.json").write_text(json.dumps(result, indent=2))
    return 0


def compare(args, stacks: dict[str, tuple[subprocess.Popen, str]], collector: SpanCollector) -> dict:
    """Requests alternate between the stacks, each first in turn; tokens/s and the services'
    CPU ms per token of each."""
    prompts = code_completion_prompts(8)
    totals = {name: [0, 0.0] for name in stacks}
    cpu_at_start = {name: cpu_seconds(process.pid) for name, (process, _) in stacks.items()}
    try:
        with httpx.Client(timeout=300) as client:
            for turn in range(args.rounds * len(prompts)):
                prompt = prompts[turn % len(prompts)]
                order = list(stacks.items())
                flip = (turn + turn // len(prompts)) % 2  # each stack first on every prompt in turn
                for name, (_, url) in order[::-1] if flip else order:
                    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                    started = time.perf_counter()
                    usage = client.post(f"{url}/v1/completions", json=body).json()["usage"]
                    totals[name][0] += usage["completion_tokens"]
                    totals[name][1] += time.perf_counter() - started
        cpu = {name: cpu_seconds(process.pid) - cpu_at_start[name] for name, (process, _) in stacks.items()}
    finally:
        for process, _ in stacks.values():
            process.terminate()
            process.wait(timeout=60)
        collector.stop()
    return {
        "tokens_per_s": {name: tokens / seconds for name, (tokens, seconds) in totals.items()},
        # CPU time per token of the three services: less noisy than wall time on a shared machine
        "cpu_ms_per_token": {name: 1e3 * cpu[name] / totals[name][0] for name in totals},
        "spans_received": len(collector.snapshot()),
    }


if __name__ == "__main__":
    sys.exit(main())
