"""Shared fixtures: a tiny random model pair, and the whole stack started as real processes
on loopback ports through `specserve up`: as it starts by default (the verifier drafts for
itself), and with a draft service of its own (`--draft-service`)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; must be set before triton.jit runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specserve.methods.medusa import MedusaConfig, MedusaHeads, save_heads  # noqa: E402
from specserve.tools.testing import save_pair  # noqa: E402


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: a port the kernel picked
    (bind to 0) can be handed to a client's outgoing connection before the stack binds it."""
    floor = _ephemeral_floor()
    for _ in range(100):
        port = random.randrange(10000, max(floor, 10001))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    url: str
    draft_address: str  # "" without a draft service
    verify_address: str
    target_dir: Path
    draft_dir: Path
    process: subprocess.Popen
    metrics_ports: tuple[int, int] = (0, 0)  # (the draft service's, the verifier's) Prometheus ports


def wait_until_healthy(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the stack exited with code {process.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def up_command(
    target_dir: Path,
    draft_dir: Path,
    port: int,
    draft_port: int,
    verify_port: int,
    metrics_ports: tuple[int, int] | None = None,
    draft_service: bool = False,
) -> list[str]:
    draft_metrics, verify_metrics = metrics_ports or (free_port(), free_port())
    return [
        sys.executable, "-m", "specserve.cli", "up", "--port", str(port), "--draft-port", str(draft_port),
        "--verify-port", str(verify_port), "--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu",
        "--draft-metrics-port", str(draft_metrics), "--verify-metrics-port", str(verify_metrics),
        *(["--draft-service"] if draft_service else []),
        *(["--medusa", str(medusa_dir(target_dir))] if medusa_dir(target_dir).is_dir() else []),
    ]  # fmt: skip


def start_stack(
    target_dir: Path,
    draft_dir: Path,
    env: dict[str, str] | None = None,
    metrics_ports: tuple[int, int] | None = None,
    log_path: Path | None = None,
    draft_service: bool = False,
    extra_args: list[str] | None = None,
    healthy_timeout_s: float = 120,
) -> Stack:
    """The stack on free ports, with a draft service of its own where asked; log_path, where
    given, takes what its processes log. metrics_ports: (draft service's, verifier's)."""
    port, draft_port, verify_port = free_port(), free_port(), free_port()
    metrics_ports = metrics_ports or (free_port(), free_port())
    command = up_command(target_dir, draft_dir, port, draft_port, verify_port, metrics_ports, draft_service)
    command += extra_args or []  # more of `specserve up`'s flags
    # One torch thread per service: three processes share two cores, and tiny models gain
    # nothing from intra-op threads but lose to their spinning.
    env = {
        **os.environ,
        "SPECSERVE_LOG_LEVEL": os.environ.get("SPECSERVE_LOG_LEVEL", "WARNING"),
        "SPECSERVE_VERIFY_THREADS": "1",
        "SPECSERVE_DRAFT_THREADS": "1",
        # Compiling steps costs each stack seconds of CPU; tests that want it say so.
        "SPECSERVE_DRAFT_COMPILE_STEPS": "0",
        "SPECSERVE_VERIFY_COMPILE_STEPS": "0",
        **(env or {}),
    }
    log = open(log_path, "w") if log_path is not None else None
    process = subprocess.Popen(command, env=env, stderr=log)
    if log is not None:
        log.close()  # the process holds its own copy
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, healthy_timeout_s)
    except BaseException:
        stop_process(process)
        raise
    draft_address = f"127.0.0.1:{draft_port}" if draft_service else ""
    return Stack(url, draft_address, f"127.0.0.1:{verify_port}", target_dir, draft_dir, process, metrics_ports)


def metric(port: int, name: str) -> float:
    """The value of an unlabelled metric on a service's Prometheus port."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def stop_process(process: subprocess.Popen, timeout_s: float = 30) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A random target (2 layers) and a draft made of its first layer: they agree on the
    argmax about 60% of the time, so drafts are both accepted and rejected."""
    target_dir, draft_dir = save_pair(tmp_path_factory.mktemp("tiny_pair"))
    save_heads(MedusaHeads(MedusaConfig.for_target(target_dir, 3)), medusa_dir(target_dir))
    return target_dir, draft_dir


def medusa_dir(target_dir: Path) -> Path:
    """Where a tiny target's Medusa heads lie, which the stacks started here serve (fresh
    heads: each guesses what the target's LM head guesses for the next token)."""
    return target_dir.parent / "medusa"


@pytest.fixture(scope="session")
def stack(tiny_pair) -> Stack:
    """The stack as `specserve up` starts it: the verifier drafts for itself."""
    running = start_stack(*tiny_pair)
    yield running
    stop_process(running.process)


@pytest.fixture(scope="session")
def split_stack(tiny_pair) -> Stack:
    """The stack with a draft service of its own, whose rounds go through the gateway."""
    running = start_stack(*tiny_pair, draft_service=True)
    yield running
    stop_process(running.process)
