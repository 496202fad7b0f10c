"""`specserve up`: the whole stack on one machine, as local processes under one supervisor.

The verifier (with its drafts) and the gateway, and a draft service where asked, each run as
a process of its own started by module name (`python -m verify_service`), so this module never
imports a service package. The supervisor resolves the models first (a named model such as
`smollm2` is converted once into the cache: specserve/model/gguf.py), starts the parts, waits
for the gateway's health, and restarts a part that dies, as a kubelet would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specserve.paths import DEMO_DRAFT, DEMO_MEDUSA, DEMO_TARGET, REPO_ROOT, missing_tokenizer

NO_DRAFT = ("", "none")  # --draft values that mean: serve without a draft model

# After each parallel op torch's OpenMP threads spin, by default for about 300,000 turns,
# before they sleep. Where a draft service and a verifier share a machine's cores, a
# service's spinning threads take the core from the one that runs next: on this project's
# 2-core machine a decode step of one ran up to twice as slow right after the other's.
# 30,000 turns still span the gaps between one forward's ops (docs/benchmarks.md). A
# verifier that drafts for itself runs both models on one pool of threads, and there the
# default spin measured faster: `specserve up` without a draft service leaves it. Only a
# default: an environment that sets GOMP_SPINCOUNT (or OMP_WAIT_POLICY) keeps its own.
SERVICE_ENVIRONMENT = {"GOMP_SPINCOUNT": "30000"}

# Where the draft service, the verifier and the gateway share one machine's CPU cores, a
# speculative round of one request takes cores from the others' rounds. On this project's
# 2-core machine (demo pair, code, greedy, K = 4; two runs each) speculation against
# target-only went from 0.79-0.81x, 0.64-0.66x and 0.79-0.86x at 2, 4 and 16 clients to
# 0.93-0.94x, 0.95-1.08x and 0.88-1.07x with this limit, and stayed 1.10-1.17x at one
# (docs/benchmarks.md). So a stack on the CPU speculates while one request runs and decodes
# the others target-only; on a GPU the target's pass stays bound by memory traffic, and
# batching K + 1 tokens of many requests is meant to pay under load too: no limit.
CPU_MAX_SPECULATING_REQUESTS = 1


def service_environment() -> None:
    """Sets SERVICE_ENVIRONMENT's defaults for the service processes started from here."""
    if "OMP_WAIT_POLICY" not in os.environ:
        for key, value in SERVICE_ENVIRONMENT.items():
            os.environ.setdefault(key, value)


EARLY_EXIT_LAYERS = 2  # the demo target's first layers that method early_exit drafts with
EARLY_EXIT_FRACTION = 4  # a draft service drafts another target with its first quarter of layers


def resolve_models(args: argparse.Namespace) -> str | None:
    """Sets args.target, args.draft, args.medusa and args.eagle to the directories served (a
    named target converted first; the draft: the demo's with the demo target, else none; the
    heads: the demo's with the demo target, a named model's under models/NAME/medusa and
    models/NAME/eagle where the repository ships them; unless asked); returns why they cannot
    be served, in one line, or None."""
    from specserve.model.gguf import ModelNotFound, is_named, log_conversions, resolve_model

    log_conversions()

    named = is_named(args.target)
    shipped = REPO_ROOT / "models" / args.target if named else None  # where the repository ships a model's heads
    try:
        args.target = resolve_model(args.target)
        demo = _is_demo(args.target)
        draft = args.draft if args.draft is not None else str(DEMO_DRAFT) if demo else ""
        args.draft = "" if draft.strip().lower() in NO_DRAFT else resolve_model(draft)
    except (ModelNotFound, ValueError, OSError) as error:
        return f"specserve: {error}"
    if args.medusa is None:
        args.medusa = _heads_in(DEMO_MEDUSA if demo else shipped / "medusa" if shipped else None)
    if args.eagle is None:
        args.eagle = _heads_in(shipped / "eagle" if shipped else None)
    roles = (("target", args.target), ("draft", args.draft)) if args.draft else (("target", args.target),)
    for role, path in roles:
        if not (Path(path) / "config.json").is_file():
            hint = " (or --draft none)" if role == "draft" else ""
            return f"specserve: no {role} model at {path} (no config.json); pass --{role} DIR{hint}"
        missing = missing_tokenizer(path)
        if missing:
            return f"specserve: the {role} model at {path} has {missing}"
    if args.draft_service and not args.draft:
        return "specserve: --draft-service runs a draft model: pass --draft DIR, or leave --draft-service out"
    return None


def _heads_in(directory: Path | None) -> str:
    """directory where it holds heads (a config.json), else ''."""
    return str(directory) if directory is not None and (directory / "config.json").is_file() else ""


def _is_demo(target: str) -> bool:
    return Path(target).resolve() == DEMO_TARGET.resolve()


def early_exit_layers(target: str) -> int:
    """The target's first layers that a draft service's early_exit drafts with: the demo's 2,
    another's first quarter (at least 2). A verifier that drafts for itself chooses another
    target's count from measured agreement instead (--early-exit-layers -1)."""
    if _is_demo(target):
        return EARLY_EXIT_LAYERS
    layers = int(json.loads((Path(target) / "config.json").read_text()).get("num_hidden_layers", 0))
    return max(EARLY_EXIT_LAYERS, layers // EARLY_EXIT_FRACTION)


def default_method(args: argparse.Namespace) -> str | None:
    """The method of requests that name none, where `up` chooses it: the draft model where one
    is served (the gateway's own default), else the Medusa heads, else n-gram copies (free
    where the context does not repeat). An EAGLE head is served for requests that name it:
    on SmolLM2 it has not yet paid (docs/benchmarks.md, "EAGLE heads on SmolLM2")."""
    if args.method or args.draft:
        return args.method
    return "medusa" if args.medusa else "ngram"


def _service_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    python = [sys.executable, "-m"]
    verify = [
        *python,
        "verify_service",
        "--model",
        args.target,
        "--port",
        str(args.verify_port),
        "--device",
        args.device,
        "--metrics-port",
        str(args.verify_metrics_port),
    ]
    verify += ["--trace-console"] if args.trace_console else []
    verify += ["--medusa", args.medusa] if args.medusa else []
    verify += ["--eagle", args.eagle] if args.eagle else []
    copy = [] if args.copy_min_ngram is None else ["--copy-min-ngram", str(args.copy_min_ngram)]
    early_exit = ["--early-exit-layers", str(early_exit_layers(args.target))]
    if not args.draft_service:
        # The verifier chooses another target's count from measured agreement (-1).
        own_exit = early_exit if _is_demo(args.target) else ["--early-exit-layers", "-1"]
        return {"verify": [*verify, *(["--draft-model", args.draft] if args.draft else []), *own_exit, *copy]}
    return {
        "verify": [*verify, *copy],
        "draft": [
            *python,
            "draft_service",
            "--model",
            args.draft,
            "--port",
            str(args.draft_port),
            "--device",
            args.device,
            "--metrics-port",
            str(args.draft_metrics_port),
            "--early-exit-model",
            args.target,
            *early_exit,
            *copy,
            *(["--trace-console"] if args.trace_console else []),
        ],
    }


def _gateway_command(args: argparse.Namespace) -> list[str]:
    draft_address = f"127.0.0.1:{args.draft_port}" if args.draft_service else ""
    defaults = [
        *(["--method", default_method(args)] if default_method(args) else []),
        *(
            ["--num-speculative-tokens", str(args.num_speculative_tokens)]
            if args.num_speculative_tokens is not None
            else []
        ),
        *([] if args.adaptive is None else ["--adaptive" if args.adaptive else "--no-adaptive"]),
        *([] if args.pipeline is None else ["--pipeline" if args.pipeline else "--no-pipeline"]),
        *(["--tree", args.tree] if args.tree else []),
    ]
    return [
        sys.executable,
        "-m",
        "gateway",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--tokenizer",
        args.target,
        "--draft-address",
        draft_address,
        "--verify-address",
        f"127.0.0.1:{args.verify_port}",
        *_speculation_limit(args.max_speculating_requests, args.device, args.draft_service),
        *defaults,
        *(["--trace-console"] if args.trace_console else []),
    ]


def _speculation_limit(asked: str, device: str, draft_service: bool) -> list[str]:
    """The gateway's --max-speculating-requests flag for `up --max-speculating-requests asked`:
    auto is CPU_MAX_SPECULATING_REQUESTS where a draft service drafts for models on the CPU,
    and no flag otherwise (the gateway's own default, or SPECSERVE_GATEWAY_MAX_SPECULATING_REQUESTS
    where that is set). Where the verifier drafts for itself, its choice of K sees the batch
    and stops drafting where drafts do not pay for their rows (docs/design.md, "Choosing K");
    the gateway's choice for a draft service's rounds does not see the verifier's batch."""
    if asked != "auto":
        return ["--max-speculating-requests", asked]
    if os.environ.get("SPECSERVE_GATEWAY_MAX_SPECULATING_REQUESTS") or not draft_service or not _on_cpu(device):
        return []
    return ["--max-speculating-requests", str(CPU_MAX_SPECULATING_REQUESTS)]


def _on_cpu(device: str) -> bool:
    """Whether the services resolve device to the CPU (imports torch: a second or two)."""
    from specserve.config import resolve_device

    try:
        return resolve_device(device).type == "cpu"
    except (RuntimeError, ValueError):  # not a device, or CUDA where there is none: the services say so
        return False


def up(args: argparse.Namespace) -> int:
    if args.max_speculating_requests != "auto" and not args.max_speculating_requests.isdigit():
        print("specserve: --max-speculating-requests takes auto or a count (0: no limit)", file=sys.stderr)
        return 2
    busy = _busy_port(args)
    if busy:
        print(busy, file=sys.stderr)
        return 2
    refused = resolve_models(args)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    stopping = {"signal": None}

    def request_stop(signum, _frame):
        stopping["signal"] = signum

    # The parts run in sessions of their own: a Ctrl-C reaches this supervisor only, which
    # stops them (SIGTERM: each drains and leaves quietly) and says so in one line.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(signum, request_stop)
    commands = _service_commands(args)
    processes = {name: _start(command) for name, command in commands.items()}
    try:
        # Built once the services load: resolving --device for its speculation limit imports torch.
        commands["gateway"] = _gateway_command(args)
        processes["gateway"] = _start(commands["gateway"])
        url = f"http://{args.host}:{args.port}"
        if not _wait_healthy(url, processes, args.startup_timeout, stopping):
            return 0 if stopping["signal"] is not None else 1
        _print_welcome(url, _is_demo(args.target))
        _supervise(commands, processes, stopping)
        return 0
    except KeyboardInterrupt:  # a Ctrl-C before the handler above was set
        return 0
    finally:
        _stop_all(processes)
        if stopping["signal"] is not None:
            print("specserve: stopped", file=sys.stderr, flush=True)


def _start(command: list[str]) -> subprocess.Popen:
    """A part in a session of its own, which Linux stops (SIGTERM) should this supervisor die
    without stopping it (SIGKILL, the OOM killer)."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # noqa: N806 - prctl's name
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _busy_port(args: argparse.Namespace) -> str | None:
    """One line naming the first port (and its flag) that is taken or given twice, before
    anything loads; None when all are free."""
    from specserve.ports import first_busy_port

    ports = [
        (args.host, args.port, "--port"),
        ("127.0.0.1", args.verify_port, "--verify-port"),
        ("127.0.0.1", args.verify_metrics_port, "--verify-metrics-port"),
    ]
    if args.draft_service:
        ports += [
            ("127.0.0.1", args.draft_port, "--draft-port"),
            ("127.0.0.1", args.draft_metrics_port, "--draft-metrics-port"),
        ]
    return first_busy_port("specserve up", ports)


def _supervise(commands: dict[str, list[str]], processes: dict[str, subprocess.Popen], stopping: dict) -> None:
    """As a Kubernetes kubelet would: a part that dies is started again after a pause that
    doubles with each quick death (1 s up to 30 s) and resets once it has run for a minute."""
    restarts = dict.fromkeys(commands, 0)
    started = dict.fromkeys(commands, time.monotonic())
    due: dict[str, float] = {}
    while stopping["signal"] is None:
        now = time.monotonic()
        for name, process in processes.items():
            if process.poll() is None or name in due:
                continue
            if now - started[name] > 60:
                restarts[name] = 0
            pause = min(30.0, 2.0 ** restarts[name])
            print(
                f"specserve: {name} exited with code {process.returncode}; restarting in {pause:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            due[name] = now + pause
        for name, when in list(due.items()):
            if now >= when:
                processes[name] = _start(commands[name])
                restarts[name] += 1
                started[name] = now
                del due[name]
                print(f"specserve: {name} restarted (pid {processes[name].pid})", file=sys.stderr, flush=True)
        time.sleep(0.2)


def _wait_healthy(url: str, processes: dict[str, subprocess.Popen], timeout_s: float, stopping: dict) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and stopping["signal"] is None:
        dead = _first_exited(processes)
        if dead:
            print(f"specserve: {dead} exited with code {processes[dead].returncode} during start-up", file=sys.stderr)
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    if stopping["signal"] is None:
        print(f"specserve: not healthy after {timeout_s:.0f} s", file=sys.stderr)
    return False


def _first_exited(processes: dict[str, subprocess.Popen]) -> str | None:
    return next((name for name, process in processes.items() if process.poll() is not None), None)


def _stop_all(processes: dict[str, subprocess.Popen]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for process in processes.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its session: a part's own children too
            except ProcessLookupError:
                pass
            process.wait()


def _print_welcome(url: str, demo: bool) -> None:
    """One request to try: the demo's code completion, or a chat message for another model."""
    if demo:
        request = f"{url}/v1/completions", '{"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}'
    else:
        message = '{"role": "user", "content": "Why is the sky blue?"}'
        request = f"{url}/v1/chat/completions", f'{{"messages": [{message}], "max_tokens": 96}}'
    print(
        f"\nspecserve is up: {url}\n\n"
        f"  curl {request[0]} -H 'Content-Type: application/json' \\\n"
        f"    -d '{request[1]}'\n\n"
        "Ctrl-C stops all the services.\n",
        flush=True,
    )
