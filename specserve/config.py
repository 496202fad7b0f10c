"""Service configs: one small dataclass per service, from which the command-line flags and
the SPECSERVE_* environment variables are derived, so the three never drift apart.

A field `max_sessions` of the verify service's config becomes the flag `--max-sessions`
and the variable `SPECSERVE_VERIFY_MAX_SESSIONS`; precedence is flag, then variable, then
the field's default. Each field's `help` metadata is its flag's help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

ConfigT = TypeVar("ConfigT")

_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def field(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text for its flag."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def env_name(prefix: str, field_name: str) -> str:
    return f"SPECSERVE_{prefix}_{field_name}".upper()


def add_arguments(parser: argparse.ArgumentParser, config_cls: type, prefix: str) -> None:
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        env = env_name(prefix, f.name)
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {f.default!r}]"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=_scalar_type(kind), default=None, help=help_text)


def from_arguments(config_cls: type[ConfigT], args: argparse.Namespace, prefix: str) -> ConfigT:
    """Builds the config from parsed flags, falling back to environment variables."""
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        value = getattr(args, f.name, None)
        if value is None and env_name(prefix, f.name) in os.environ:
            value = _parse_env(os.environ[env_name(prefix, f.name)], hints[f.name], env_name(prefix, f.name))
        if value is not None:
            values[f.name] = value
    return config_cls(**values)


def parse_config(
    config_cls: type[ConfigT], prefix: str, argv: Sequence[str] | None, prog: str, description: str
) -> ConfigT:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, config_cls, prefix)
    args = parser.parse_args(argv)
    try:
        return from_arguments(config_cls, args, prefix)
    except ValueError as error:
        parser.error(str(error))
        raise  # parser.error exits; this keeps type checkers content


def _scalar_type(kind: Any) -> type:
    args = typing.get_args(kind)
    if args:  # Optional[X] -> X
        kind = next(a for a in args if a is not type(None))
    return kind


def _parse_env(raw: str, kind: Any, name: str) -> Any:
    kind = _scalar_type(kind)
    if kind is bool:
        if raw.strip().lower() not in _BOOL_WORDS:
            raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")
        return _BOOL_WORDS[raw.strip().lower()]
    try:
        return kind(raw)
    except ValueError as error:
        raise ValueError(f"{name}={raw!r}: {error}") from None


def check(condition: bool, message: str) -> None:
    """Config validation in __post_init__: a ValueError becomes a usage error on the CLI."""
    if not condition:
        raise ValueError(message)


CPUS_HELP = (
    "CPU ids to pin the service to, as taskset -c takes them ('1', '0,2', '2-3'; empty: all); threads, "
    "when 0, become one per CPU. A draft service and a verifier sharing a machine, each on cores of its "
    "own, overlap pipelined rounds for real"
)


def parse_cpus(spec: str) -> frozenset[int]:
    """CPU ids as `taskset -c` writes them ('1', '0,2', '2-3'); '' is no pinning (empty).
    Every id must be one this process may run on."""
    cpus: set[int] = set()
    for part in (p.strip() for p in spec.split(",")) if spec.strip() else ():
        low, dash, high = part.partition("-")
        check(low.isdigit() and (not dash or high.isdigit()), f"cpus: {part!r} is not a CPU id or a range like 2-3")
        first, last = int(low), int(high) if dash else int(low)
        check(first <= last, f"cpus: range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    if cpus:
        check(hasattr(os, "sched_setaffinity"), "cpus: this platform cannot pin a process to CPUs")
        allowed = os.sched_getaffinity(0)
        check(cpus <= allowed, f"cpus: {sorted(cpus - allowed)} not among this process's CPUs {sorted(allowed)}")
    return frozenset(cpus)


def pin_to_cpus(spec: str) -> None:
    """Pins every thread of this process, and all it starts later, to the CPUs of spec (see
    parse_cpus); an empty spec changes nothing."""
    cpus = parse_cpus(spec)
    if not cpus:
        return
    threads = [int(tid) for tid in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    check(
        resolved.type != "cuda" or torch.cuda.is_available(), f"device {device!r} asked for, but CUDA is not available"
    )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' means float32 on the CPU (fast kernels, exact enough) and bfloat16 on CUDA."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    check(dtype in names, f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    return names[dtype]


@dataclasses.dataclass(frozen=True)
class TracingOptions:
    """Tracing fields every service config has (see specserve.serving.telemetry)."""

    trace_console: bool = field(
        False, "print spans to stdout (OTLP export is on when OTEL_EXPORTER_OTLP_ENDPOINT is set)"
    )
    trace_sample_ratio: float = field(1.0, "fraction of traces recorded, decided once per request at the gateway")

    def check_tracing(self) -> None:
        check(0.0 <= self.trace_sample_ratio <= 1.0, "trace_sample_ratio must lie in [0, 1]")
