"""The `specserve` command as a newcomer meets it: every subcommand's help, busy ports found
before anything loads, a Ctrl-C that stops everything quietly, the gateway's request
defaults passed on by `specserve up`, and a gateway that answers while it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, metric, start_stack, stop_process, up_command

SUBCOMMANDS = ["up", "draft", "verify", "gateway", "bench", "load", "fuzz", "trace", "eval-demo", "train-demo"]


def specserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_every_subcommand_is_listed_and_its_help_shows_defaults():
    listing = specserve("--help")
    assert listing.returncode == 0
    for name in [*SUBCOMMANDS, "gen-protos"]:
        assert name in listing.stdout, name
    with ThreadPoolExecutor(4) as pool:  # each starts Python and imports torch: seconds, mostly waiting
        helps = dict(zip(SUBCOMMANDS, pool.map(lambda name: specserve(name, "--help"), SUBCOMMANDS)))
    for name, helped in helps.items():
        assert helped.returncode == 0 and "default" in helped.stdout, (name, helped.stdout[-500:], helped.stderr)
    assert "usage: specserve train-demo" in helps["train-demo"].stdout


def listening(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize("flag", ["--port", "--verify-port", "--verify-metrics-port"])
def test_a_busy_port_stops_up_at_once_in_one_line_that_names_it(tiny_pair, flag):
    port = free_port()
    ports = {"--port": str(free_port()), "--verify-port": str(free_port()), "--verify-metrics-port": str(free_port())}
    ports[flag] = str(port)
    target, draft = tiny_pair
    with listening(port):
        started = time.monotonic()
        result = specserve("up", "--target", str(target), "--draft", str(draft), "--device", "cpu",
                           *[x for item in ports.items() for x in item])  # fmt: skip
    assert result.returncode != 0 and time.monotonic() - started < 5
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port} ({flag}) is in use" in lines[0], result.stderr


def test_a_second_stack_on_the_same_grpc_ports_refuses_to_start(stack):
    verify_port = stack.verify_address.rsplit(":", 1)[1]
    result = specserve("up", "--target", str(stack.target_dir), "--draft", str(stack.draft_dir), "--device", "cpu",
                       "--port", str(free_port()), "--verify-port", verify_port)  # fmt: skip
    assert result.returncode != 0 and f"port {verify_port} (--verify-port) is in use" in result.stderr
    alone = specserve("verify", "--model", str(stack.target_dir), "--port", verify_port, "--metrics-port", "0")
    assert alone.returncode == 2 and f"port {verify_port} (--port) is in use" in alone.stderr
    assert "Traceback" not in alone.stderr


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_ctrl_c_during_start_up_stops_every_part_without_a_traceback(tiny_pair):
    port, verify_port = free_port(), free_port()
    command = up_command(*tiny_pair, port, free_port(), verify_port)
    env = {**os.environ, "SPECSERVE_VERIFY_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "specserve: stopped", err[-500:]
    deadline = time.monotonic() + 10
    while _processes_with(f"{verify_port}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(f"{verify_port}")


def test_up_passes_the_request_defaults_on_and_the_gateway_answers_while_it_starts(tiny_pair):
    """`--method ngram`: a request that names no method drafts by n-gram (the verifier's
    draft model holds no cache slot meanwhile); before it is ready, /health answers 503."""
    stack = start_stack(*tiny_pair, env={}, extra_args=["--method", "ngram", "--no-adaptive"])
    try:
        _, verify_metrics = stack.metrics_ports
        body = {"prompt": [7, 8, 9] * 20, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json=body) as reply:
                next(reply.iter_lines())
                assert metric(verify_metrics, "specserve:drafter_kv_slots_in_use") == 0
        plain = httpx.post(
            f"{stack.url}/v1/completions", json={**body, "stream": False, "max_tokens": 60, "return_timings": True}
        ).json()
        assert plain["usage"]["speculation"]["num_drafts"] > 0
    finally:
        stop_process(stack.process)


def test_the_gateway_answers_503_starting_before_its_verify_service_does(tiny_pair):
    target, _ = tiny_pair
    port, verify_port = free_port(), free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "--port", str(port), "--tokenizer", str(target),
                                "--verify-address", f"127.0.0.1:{verify_port}"])  # fmt: skip
    try:
        deadline, reply = time.monotonic() + 30, None
        while reply is None and time.monotonic() < deadline:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
        assert reply is not None and reply.status_code == 503 and reply.json()["status"] == "starting"
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert completion.status_code == 503 and completion.json()["error"]["code"] == "starting"
    finally:
        stop_process(gateway)


def test_load_runs_on_a_stack_it_starts_and_reports_no_failure(tiny_pair, tmp_path):
    target, draft = tiny_pair
    report = tmp_path / "load.json"
    result = specserve("load", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--clients", "4",
                       "--duration", "10", "--max-tokens", "16", "--output", str(report), timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "failed: 0" in result.stdout and report.is_file()
