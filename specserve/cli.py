"""The `specserve` command: start the whole stack on one machine, or one part of it.

Each service runs as its own process, started by module name (`python -m draft_service`),
so this module never imports a service package.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specserve.paths import DEMO_DRAFT, DEMO_MEDUSA, DEMO_TARGET, missing_tokenizer

SERVICE_MODULES = {"draft": "draft_service", "verify": "verify_service", "gateway": "gateway"}

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


def _service_environment() -> None:
    """Sets SERVICE_ENVIRONMENT's defaults for the service processes started from here."""
    if "OMP_WAIT_POLICY" not in os.environ:
        for key, value in SERVICE_ENVIRONMENT.items():
            os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_MODULES:
        _service_environment()
        os.execv(sys.executable, [sys.executable, "-m", SERVICE_MODULES[argv[0]], *argv[1:]])
    if argv and argv[0] == "gen-protos":
        from specserve.tools.protogen import main as gen_protos

        return gen_protos(argv[1:])
    if argv and argv[0] == "bench":
        from specserve.tools.bench import main as bench

        return bench(argv[1:])
    if argv and argv[0] == "load":
        from specserve.tools.load import main as load

        return load(argv[1:])
    if argv and argv[0] == "fuzz":
        from specserve.tools.fuzz import main as fuzz

        return fuzz(argv[1:])
    if argv and argv[0] == "trace":
        from specserve.tools.trace_report import main as trace

        return trace(argv[1:])
    if argv and argv[0] == "eval-demo":
        from specserve.tools.demo_eval import main as eval_demo

        return eval_demo(argv[1:])
    if argv and argv[0] == "train-medusa":
        from specserve.tools.train_medusa import main as train_medusa

        return train_medusa(argv[1:])
    if argv and argv[0] == "train-demo":
        from specserve.tools.train_demo import main as train_demo

        return train_demo(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "up":
        if args.draft_service:
            _service_environment()
        return up(args)
    _parser().print_help()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Lossless speculative decoding over gRPC.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    up_parser = commands.add_parser("up", help="start the verifier (with its drafts) and the gateway on this machine")
    up_parser.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    up_parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    up_parser.add_argument(
        "--draft-port", type=int, default=50051, help="draft service port, with --draft-service (default 50051)"
    )
    up_parser.add_argument("--verify-port", type=int, default=50052, help="verify service port (default 50052)")
    up_parser.add_argument(
        "--draft-metrics-port",
        type=int,
        default=9101,
        help="draft service /metrics port, with --draft-service (default 9101)",
    )
    up_parser.add_argument("--verify-metrics-port", type=int, default=9102, help="verify /metrics port (default 9102)")
    _add_models(up_parser)
    up_parser.add_argument(
        "--draft-service",
        action="store_true",
        help="run the draft model in a draft service of its own (a third process, as on Kubernetes), whose "
        "rounds go through the gateway, instead of inside the verifier (default: inside, no call per round)",
    )
    up_parser.add_argument(
        "--max-speculating-requests",
        default="auto",
        help="the gateway speculates only while at most this many requests run, 0 always (default auto: "
        f"{CPU_MAX_SPECULATING_REQUESTS} when the models run on the CPU, else 0)",
    )
    up_parser.add_argument(
        "--copy-min-ngram",
        type=int,
        default=None,
        help="a model's drafts start with a copy of the context where its last tokens repeat a span this long "
        "or longer, while such copies hold the target's tokens at least as often as the model's drafts "
        "(0: never, nor in Medusa rounds; the services' default: 2)",
    )
    up_parser.add_argument("--startup-timeout", type=float, default=300, help="seconds to wait for readiness")
    _add_request_defaults(up_parser)
    up_parser.add_argument("--trace-console", action="store_true", help="every part prints its spans to stderr")
    for name in SERVICE_MODULES:
        commands.add_parser(name, help=f"run only the {name} service (`specserve {name} --help`)", add_help=False)
    commands.add_parser("gen-protos", help="regenerate the gRPC stubs from protos/ (--check to verify)", add_help=False)
    commands.add_parser("train-demo", help="train the embedded demo model pair", add_help=False)
    commands.add_parser("train-medusa", help="train Medusa heads for a frozen target", add_help=False)
    commands.add_parser(
        "fuzz", help="generated bad input against a running stack (needs the test extras)", add_help=False
    )
    commands.add_parser("trace", help="per-hop latency table and plots from a run's spans", add_help=False)
    commands.add_parser("eval-demo", help="measure the demo pair's model-card figures", add_help=False)
    commands.add_parser("bench", help="speculative vs target-only through a running gateway", add_help=False)
    commands.add_parser(
        "load", help="soak a stack it starts with streaming clients, checking every greedy output", add_help=False
    )
    return parser


EARLY_EXIT_LAYERS = 2  # the target's first layers that method early_exit drafts with


def _add_models(up_parser: argparse.ArgumentParser) -> None:
    up_parser.add_argument("--target", default=str(DEMO_TARGET), help="target model directory (default: the demo one)")
    up_parser.add_argument("--draft", default=str(DEMO_DRAFT), help="draft model directory (default: the demo draft)")
    up_parser.add_argument("--medusa", default=None,
                           help="Medusa heads for the target, served as method medusa by the verifier ('' for none; "
                                "default: the demo's heads with the demo target, else none)")  # fmt: skip
    up_parser.add_argument("--device", default="auto", help="torch device for both models (default auto)")


def _add_request_defaults(up_parser: argparse.ArgumentParser) -> None:
    """The gateway's request defaults (what a request that does not say gets), passed on."""
    up_parser.add_argument("--method", choices=("draft_model", "early_exit", "ngram", "suffix", "medusa", "lookahead", "none"), default=None,
                           help="speculation method of requests that set none (the gateway's default: draft_model)")  # fmt: skip
    up_parser.add_argument("--num-speculative-tokens", type=int, default=None,
                           help="K of requests that set none, where adaptive K starts (the gateway's default: 4)")  # fmt: skip
    up_parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                           help="choose each round's K by measured cost, for requests that do not say (default on)")  # fmt: skip
    up_parser.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                           help="pipeline a draft service's rounds, for requests that do not say (default off)")  # fmt: skip
    up_parser.add_argument("--tree", default=None,
                           help="a token tree for requests that set none: children per depth ('2,1,1') or paths "
                                "('[[0],[0,0],[1]]'); with adaptive, taken where it beats chains (default: chains)")  # fmt: skip


def _service_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    python = [sys.executable, "-m"]
    verify = [*python, "verify_service", "--model", args.target, "--port", str(args.verify_port), "--device",
              args.device, "--metrics-port", str(args.verify_metrics_port)]  # fmt: skip
    verify += ["--trace-console"] if args.trace_console else []
    verify += ["--medusa", _medusa(args)] if _medusa(args) else []
    copy = [] if args.copy_min_ngram is None else ["--copy-min-ngram", str(args.copy_min_ngram)]
    if not args.draft_service:
        return {"verify": [*verify, "--draft-model", args.draft, "--early-exit-layers", str(EARLY_EXIT_LAYERS), *copy]}
    return {
        "verify": [*verify, *copy],
        "draft": [*python, "draft_service", "--model", args.draft, "--port", str(args.draft_port), "--device", args.device,
                  "--metrics-port", str(args.draft_metrics_port), "--early-exit-model", args.target,
                  "--early-exit-layers", str(EARLY_EXIT_LAYERS), *copy,
                  *(["--trace-console"] if args.trace_console else [])],
    }  # fmt: skip


def _medusa(args: argparse.Namespace) -> str:
    """The heads directory the verifier loads: asked, or the demo's with the demo target."""
    demo = Path(args.target).resolve() == DEMO_TARGET.resolve() and (DEMO_MEDUSA / "config.json").is_file()
    return args.medusa if args.medusa is not None else str(DEMO_MEDUSA) if demo else ""


def _gateway_command(args: argparse.Namespace) -> list[str]:
    draft_address = f"127.0.0.1:{args.draft_port}" if args.draft_service else ""
    defaults = [
        *(["--method", args.method] if args.method else []),
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
        sys.executable, "-m", "gateway", "--host", args.host, "--port", str(args.port), "--tokenizer", args.target,
        "--draft-address", draft_address, "--verify-address", f"127.0.0.1:{args.verify_port}",
        *_speculation_limit(args.max_speculating_requests, args.device), *defaults,
        *(["--trace-console"] if args.trace_console else []),
    ]  # fmt: skip


def _speculation_limit(asked: str, device: str) -> list[str]:
    """The gateway's --max-speculating-requests flag for `up --max-speculating-requests asked`:
    auto is CPU_MAX_SPECULATING_REQUESTS for models on the CPU, and no flag otherwise (the
    gateway's own default, or SPECSERVE_GATEWAY_MAX_SPECULATING_REQUESTS where that is set)."""
    if asked != "auto":
        return ["--max-speculating-requests", asked]
    if os.environ.get("SPECSERVE_GATEWAY_MAX_SPECULATING_REQUESTS") or not _on_cpu(device):
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
    for role, path in (("target", args.target), ("draft", args.draft)):
        if not (Path(path) / "config.json").is_file():
            print(f"specserve: no {role} model at {path} (no config.json); pass --{role} DIR", file=sys.stderr)
            return 2
        missing = missing_tokenizer(path)
        if missing:
            print(f"specserve: the {role} model at {path} has {missing}", file=sys.stderr)
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
        _print_welcome(url)
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

    ports = [(args.host, args.port, "--port"), ("127.0.0.1", args.verify_port, "--verify-port"),
             ("127.0.0.1", args.verify_metrics_port, "--verify-metrics-port")]  # fmt: skip
    if args.draft_service:
        ports += [("127.0.0.1", args.draft_port, "--draft-port"),
                  ("127.0.0.1", args.draft_metrics_port, "--draft-metrics-port")]  # fmt: skip
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


def _print_welcome(url: str) -> None:
    print(
        f"\nspecserve is up: {url}\n\n"
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
        '    -d \'{"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}\'\n\n'
        "Ctrl-C stops all the services.\n",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
