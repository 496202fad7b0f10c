"""`specserve load`: a bounded soak test on loopback. N streaming clients for T seconds with
mixed parameters and cancellations, and the draft service killed (SIGKILL) once midway;
`specserve up`'s supervisor restarts it. Reports requests, tokens, errors, latency p50/p99,
and checks every completed greedy output against its reference (target-only, undisturbed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve.paths import DEMO_DRAFT, DEMO_TARGET
from specserve.tools.bench import start_stack, stream_chunks


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, **counts) -> None:
        with self.lock:
            for key, value in counts.items():
                if key == "error":
                    self.errors.append(value)
                elif key == "latency":
                    self.latencies.append(value)
                else:
                    setattr(self, key, getattr(self, key) + value)


def stream(client: httpx.Client, url: str, body: dict, cancel_after: int | None) -> tuple[list[int], bool]:
    """Streams one completion; returns (token ids, whether it was cancelled by us)."""
    tokens: list[int] = []
    with client.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True, "return_token_ids": True}
    ) as reply:
        for chunk in stream_chunks(reply):
            for choice in chunk["choices"]:
                tokens.extend(choice.get("token_ids", []))
            if cancel_after is not None and len(tokens) >= cancel_after:
                return tokens, True  # leaving the with-block closes the connection mid-stream
    return tokens, False


def client_loop(
    url: str, prompts: list[str], references: dict, stop_at: float, seed: int, tally: Tally, max_tokens: int,
    methods: tuple[str, ...] = ("draft_model", "draft_model", "ngram", "none"),
) -> None:  # fmt: skip
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < stop_at:
            prompt = rng.choice(prompts)
            greedy = rng.random() < 0.5
            body = {"prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0.0 if greedy else rng.choice([0.7, 1.0]),
                    "seed": rng.randrange(2**31),
                    "speculation": {"method": rng.choice(methods),
                                    "num_speculative_tokens": rng.choice([1, 2, 4, 6])}}  # fmt: skip
            cancel_after = rng.randrange(1, max_tokens) if rng.random() < 0.1 else None
            started = time.monotonic()
            tally.add(requests=1)
            try:
                tokens, cancelled = stream(client, url, body, cancel_after)
            except Exception as error:  # noqa: BLE001 - every failure is counted and reported
                tally.add(error=f"{type(error).__name__}: {error}")
                continue
            if cancelled:
                tally.add(cancelled=1)
                continue
            tally.add(completed=1, tokens=len(tokens), latency=time.monotonic() - started)
            if greedy:
                tally.add(greedy_checked=1, greedy_mismatches=int(tokens != references[prompt]))


def served(client: httpx.Client, url: str, prompt: str, methods: tuple[str, ...]) -> tuple[str, ...]:
    """Those of methods the stack serves (medusa: where it has the target's heads; lookahead:
    on the runner backend)."""
    out = []
    for method in methods:
        body = {"prompt": prompt, "max_tokens": 1, "speculation": {"method": method}}
        if client.post(f"{url}/v1/completions", json=body).status_code == 200:
            out.append(method)
    return tuple(out)


def kill_draft(draft_port: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"draft_service" in argv and str(draft_port).encode() in argv:
            os.kill(int(entry.name), signal.SIGKILL)
            return int(entry.name)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve load",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--target", default=str(DEMO_TARGET), help="target model directory (the demo's)")
    parser.add_argument("--draft", default=str(DEMO_DRAFT), help="draft model directory (the demo's)")
    parser.add_argument("--device", default="auto", help="device of the stack it starts (auto: CUDA when present)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients, 1..1024")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load, 1..3600")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="do not kill the draft service midway")
    parser.add_argument("--output", default="bench-results/load.json", help="where the JSON report goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.clients < 1 or args.clients > 1024 or not 1 <= args.duration <= 3600:
        parser.error("clients must lie in 1..1024 and duration in 1..3600 s")
    from specserve.tools.workloads import code_completion_prompts

    prompts = code_completion_prompts(12, context_lines=8)
    args.draft_service = True  # the draft service it kills midway
    process, url, ports = start_stack(args, with_ports=True)
    try:
        with httpx.Client(timeout=300) as client:
            target_only = {"max_tokens": args.max_tokens, "temperature": 0, "speculation": {"method": "none"}}
            references = {p: stream(client, url, {"prompt": p, **target_only}, None)[0] for p in prompts}
            methods = (
                "draft_model",
                "draft_model",
                "ngram",
                "none",
                *served(client, url, prompts[0], ("medusa", "lookahead")),
            )
        tally = Tally()
        stop_at = time.monotonic() + args.duration
        threads = [threading.Thread(target=client_loop,
                                    args=(url, prompts, references, stop_at, i, tally, args.max_tokens, methods))
                   for i in range(args.clients)]  # fmt: skip
        for thread in threads:
            thread.start()
        killed = None
        if args.kill:
            time.sleep(args.duration / 2)
            killed = kill_draft(ports["draft"])
            print(f"killed the draft service (pid {killed}) at {args.duration / 2:.0f} s", file=sys.stderr, flush=True)
        for thread in threads:
            thread.join()
    finally:
        process.terminate()
        process.wait(timeout=60)
    latencies = sorted(tally.latencies)
    report = {
        "clients": args.clients, "duration_s": args.duration, "methods": sorted(set(methods)),
        "draft_killed_pid": killed,
        "requests": tally.requests, "completed": tally.completed, "cancelled": tally.cancelled,
        "failed": len(tally.errors), "errors": tally.errors[:20], "tokens": tally.tokens,
        "tokens_per_s": tally.tokens / args.duration,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "greedy_checked": tally.greedy_checked, "greedy_mismatches": tally.greedy_mismatches,
    }  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    for key, value in report.items():
        if key != "errors":
            print(f"{key:>20}: {value}")
    for error in tally.errors[:5]:
        print(f"  error: {error}")
    return 0 if not tally.errors and not tally.greedy_mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
