"""The `specserve` command: start the whole stack on one machine (`up`, specserve/up.py), one
part of it, or one of the tools (bench, training, conversion).

Each service runs as its own process, started by module name (`python -m draft_service`),
so this module never imports a service package.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from specserve.methods import registry
from specserve.model.gguf import NAMED_MODELS
from specserve.paths import DEMO_TARGET
from specserve.up import CPU_MAX_SPECULATING_REQUESTS, service_environment, up

SERVICE_MODULES = {"draft": "draft_service", "verify": "verify_service", "gateway": "gateway"}

# Tools: command -> (module, its help line). Each parses its own arguments.
TOOLS = {
    "gen-protos": ("specserve.tools.protogen", "regenerate the gRPC stubs from protos/ (--check to verify)"),
    "convert-gguf": ("specserve.model.gguf", "convert a Llama-family GGUF file into a model directory"),
    "train-demo": ("specserve.tools.train_demo", "train the embedded demo model pair"),
    "train-medusa": ("specserve.tools.train_medusa", "train Medusa heads for a frozen target"),
    "train-eagle": ("specserve.tools.train_eagle", "train an EAGLE head for a frozen target on its own answers"),
    "fuzz": ("specserve.tools.fuzz", "generated bad input against a running stack (needs the test extras)"),
    "trace": ("specserve.tools.trace_report", "per-hop latency table and plots from a run's spans"),
    "eval-demo": ("specserve.tools.demo_eval", "measure the demo pair's model-card figures"),
    "bench": ("specserve.tools.bench", "speculative vs target-only through a running gateway"),
    "load": ("specserve.tools.load", "soak a stack it starts with streaming clients, checking every greedy output"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_MODULES:
        service_environment()
        os.execv(sys.executable, [sys.executable, "-m", SERVICE_MODULES[argv[0]], *argv[1:]])
    if argv and argv[0] in TOOLS:
        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "up":
        if args.draft_service:
            service_environment()
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
        f"{CPU_MAX_SPECULATING_REQUESTS} with --draft-service on the CPU, else 0: the verifier's choice of K "
        "weighs the batch)",
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
    for name, (_, help_line) in TOOLS.items():
        commands.add_parser(name, help=help_line, add_help=False)
    return parser


def _add_models(up_parser: argparse.ArgumentParser) -> None:
    names = ", ".join(NAMED_MODELS)
    up_parser.add_argument(
        "--target",
        default=str(DEMO_TARGET),
        help=f"target model: a directory, or a named model ({names}: converted once into the cache) "
        "(default: the demo one)",
    )
    up_parser.add_argument(
        "--draft",
        default=None,
        help="draft model directory, or none (default: the demo draft with the demo target, else none; "
        "ngram, suffix, lookahead, early_exit and medusa need no draft model)",
    )
    up_parser.add_argument(
        "--medusa",
        default=None,
        help="Medusa heads for the target, served as method medusa by the verifier ('' for none; "
        "default: the demo's heads with the demo target, else none)",
    )
    up_parser.add_argument(
        "--eagle",
        default=None,
        help="an EAGLE head for the target (specserve train-eagle), served as method eagle by the verifier "
        "('' for none; default: a named model's under models/NAME/eagle where it is, else none)",
    )
    up_parser.add_argument("--device", default="auto", help="torch device for both models (default auto)")


def _add_request_defaults(up_parser: argparse.ArgumentParser) -> None:
    """The gateway's request defaults (what a request that does not say gets), passed on."""
    up_parser.add_argument(
        "--method",
        choices=(*registry.names(), registry.NONE),
        default=None,
        help="speculation method of requests that set none (default: draft_model where a draft model is served, "
        "else medusa where heads are, else ngram)",
    )
    up_parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K of requests that set none, where adaptive K starts (the gateway's default: 4)",
    )
    up_parser.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose each round's K by measured cost, for requests that do not say (default on)",
    )
    up_parser.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pipeline a draft service's rounds, for requests that do not say (default off)",
    )
    up_parser.add_argument(
        "--tree",
        default=None,
        help="a token tree for requests that set none: children per depth ('2,1,1') or paths "
        "('[[0],[0,0],[1]]'); with adaptive, taken where it beats chains (default: chains)",
    )


if __name__ == "__main__":
    sys.exit(main())
