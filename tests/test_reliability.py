"""Failures cost time, never tokens: a killed draft or verifier, a client that walks away,
a burst over capacity, a missing API key, an abandoned session."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.clients import Backends, Deadlines, DraftStream
from specserve.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from tests.conftest import free_port, metric, start_stack, stop_process

KEY = "test-key"
CPUS = sorted(os.sched_getaffinity(0))
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_pair):
    verify_metrics = free_port()
    env = {
        "SPECSERVE_GATEWAY_API_KEYS": f"other-key,{KEY}",
        "SPECSERVE_GATEWAY_MAX_CONCURRENT_REQUESTS": "1",
        "SPECSERVE_GATEWAY_DRAFT_BACKOFF_S": "0.2",
        "SPECSERVE_VERIFY_SESSION_TTL_S": "2",
        # Each service on a core of its own (the same one on a one-core machine).
        "SPECSERVE_VERIFY_CPUS": str(CPUS[0]),
        "SPECSERVE_DRAFT_CPUS": str(CPUS[-1]),
    }
    stack = start_stack(*tiny_pair, env=env, metrics_ports=(free_port(), verify_metrics), draft_service=True)
    yield stack, verify_metrics
    stop_process(stack.process)


def pid_of(module: str, port: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in argv and port.encode() in argv:
                return int(entry.name)
    raise LookupError(f"no {module} process on port {port}")


def greedy(url: str, max_tokens: int, **extra) -> dict:
    body = {"prompt": [7, 8, 9], "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def slots_in_use(port: int) -> float:
    return metric(port, "specserve:verifier_kv_slots_in_use")


def test_services_run_pinned_to_their_cpus_every_thread(guarded):
    stack, _ = guarded
    greedy(stack.url, 4)  # the services have started all their threads by now
    for module, address, cpu in (
        ("verify_service", stack.verify_address, CPUS[0]),
        ("draft_service", stack.draft_address, CPUS[-1]),
    ):
        tasks = list(Path(f"/proc/{pid_of(module, address.rsplit(':', 1)[1])}/task").iterdir())
        assert len(tasks) > 3, f"{module}: {len(tasks)} threads"
        assert {os.sched_getaffinity(int(task.name)) == {cpu} for task in tasks} == {True}, module


def test_api_key_is_required_everywhere_but_health_and_metrics(guarded):
    stack, _ = guarded
    assert httpx.get(f"{stack.url}/health").status_code == 200
    assert httpx.get(f"{stack.url}/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{stack.url}/v1/models").status_code == 401
    assert httpx.get(f"{stack.url}/v1/models", headers=AUTH).status_code == 200


def test_over_capacity_is_429_and_a_client_that_leaves_frees_its_sessions(guarded):
    stack, verify_metrics = guarded
    body = {"prompt": [1, 2], "max_tokens": 300, "temperature": 0}
    with httpx.Client(headers=AUTH, timeout=60) as client:
        with ThreadPoolExecutor(6) as pool:  # six at once against a capacity of one
            replies = list(pool.map(lambda _: client.post(f"{stack.url}/v1/completions", json=body), range(6)))
        codes = sorted(r.status_code for r in replies)
        assert 200 in codes and 429 in codes, codes
        assert all(r.headers["Retry-After"] == "1" for r in replies if r.status_code == 429)
        with client.stream("POST", f"{stack.url}/v1/completions", json={**body, "stream": True}) as stream:
            next(stream.iter_lines())  # the first chunk: the request is in flight; then walk away
        # The client left mid-stream: its place and its KV slots come back.
        deadline = time.monotonic() + 10
        while slots_in_use(verify_metrics) > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert slots_in_use(verify_metrics) == 0
        assert client.post(f"{stack.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_abandoned_verifier_session_expires(guarded):
    stack, verify_metrics = guarded
    with grpc.insecure_channel(stack.verify_address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        stub.Prefill(verify_pb2.PrefillRequest(session_id="forgotten", token_ids=[1, 2, 3],
                                               sampling=common_pb2.SamplingParams(temperature=0)))  # fmt: skip
    assert slots_in_use(verify_metrics) >= 1
    deadline = time.monotonic() + 10
    while slots_in_use(verify_metrics) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slots_in_use(verify_metrics) == 0


def streamed_tokens(url: str, body: dict, when_at: int, action) -> list[int]:
    """Streams body's completion, calling action() once when when_at tokens have arrived."""
    tokens: list[int] = []
    acted = False
    body = {**body, "stream": True, "return_token_ids": True}
    with (
        httpx.Client(headers=AUTH, timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as stream,
    ):
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            tokens.extend(chunk["choices"][0].get("token_ids", []))
            if not acted and len(tokens) >= when_at:
                action()
                acted = True
    assert acted
    return tokens


FIXED_K = {"speculation": {"adaptive": False}}  # every round drafts while drafts can be had


def wait_for_drafts(url: str, reference: list[int]) -> None:
    """Until the supervisor's restarted draft service drafts again; every output stays exact."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = greedy(url, 60, **FIXED_K)
        assert after["choices"][0]["token_ids"] == reference[:60]
        if after["usage"]["speculation"]["num_drafts"] > 0:
            return
        time.sleep(0.5)
    raise AssertionError("speculation did not resume after the draft service came back")


def test_draft_killed_midway_costs_no_token_and_speculation_resumes(guarded):
    stack, _ = guarded
    reference = greedy(stack.url, 60, speculation={"method": "none"})["choices"][0]["token_ids"]
    draft_port = stack.draft_address.rsplit(":", 1)[1]
    os.kill(pid_of("draft_service", draft_port), signal.SIGKILL)
    during = greedy(stack.url, 60, **FIXED_K)
    assert during["choices"][0]["token_ids"] == reference
    wait_for_drafts(stack.url, reference)


def test_draft_killed_mid_stream_the_stream_completes_identically(guarded):
    # The request's draft stream is open when its service dies: the next round must fall back
    # to target-only however the dead stream shows itself (a failed read or a refused write).
    stack, _ = guarded
    body = {"prompt": [7, 8, 9], "max_tokens": 300, "temperature": 0}
    reference = greedy(stack.url, 300, speculation={"method": "none"})["choices"][0]["token_ids"]
    draft_port = stack.draft_address.rsplit(":", 1)[1]
    kill = lambda: os.kill(pid_of("draft_service", draft_port), signal.SIGKILL)  # noqa: E731
    assert streamed_tokens(stack.url, body, 20, kill) == reference
    wait_for_drafts(stack.url, reference)


def test_a_draft_stream_whose_service_died_between_rounds_fails_as_a_draft_failure(guarded):
    # Under load the dead stream's status often lands while the gateway waits on the verifier;
    # the next write is then refused (asyncio.InvalidStateError), which must read as a draft
    # failure (a target-only round), not escape and end the client's stream.
    stack, _ = guarded
    reference = greedy(stack.url, 60, speculation={"method": "none"})["choices"][0]["token_ids"]
    draft_port = stack.draft_address.rsplit(":", 1)[1]
    sampling = common_pb2.SamplingParams(temperature=0)

    async def scenario() -> BaseException:
        backends = Backends(stack.draft_address, stack.verify_address, Deadlines())
        stream = DraftStream(backends, "between-rounds")
        await stream.propose([7, 8, 9], 2, sampling, {})
        os.kill(pid_of("draft_service", draft_port), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not stream._call.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            await stream.propose([7, 8, 9, 10], 2, sampling, {})
        except Exception as error:  # noqa: BLE001 - the type is what is checked
            return error
        finally:
            await stream.close()
            await backends.close()
        raise AssertionError("a proposal on a dead stream succeeded")

    error = asyncio.run(scenario())
    assert isinstance(error, grpc.RpcError | RuntimeError | TimeoutError), repr(error)
    wait_for_drafts(stack.url, reference)


def forwards_run(port: int) -> float:
    """Batched forwards the verifier process now on port has run since it started."""
    return metric(port, "specserve:verifier_forward_seconds_count")


@pytest.mark.parametrize("method", ["draft_model", "none"])
def test_verifier_killed_mid_stream_the_stream_completes_identically(guarded, method):
    # Target-only, the verifier streams tokens (Decode) without waiting for the gateway: the
    # broken stream must be picked up from the gateway's sequence, not from the dead session.
    stack, verify_metrics = guarded
    speculation = {"speculation": {"method": method}}
    reference = greedy(stack.url, 400, **speculation)["choices"][0]["token_ids"]
    verify_port = stack.verify_address.rsplit(":", 1)[1]
    body = {"prompt": [7, 8, 9], "max_tokens": 400, "temperature": 0, **speculation}
    kill = lambda: os.kill(pid_of("verify_service", verify_port), signal.SIGKILL)  # noqa: E731
    assert streamed_tokens(stack.url, body, 20, kill) == reference
    assert forwards_run(verify_metrics) > 0  # the restarted verifier finished the stream


@pytest.fixture(scope="module")
def colocated(tiny_pair):
    """The stack as `specserve up` starts it: speculative rounds run inside the verifier."""
    verify_metrics = free_port()
    env = {"SPECSERVE_GATEWAY_API_KEYS": KEY}
    stack = start_stack(*tiny_pair, env=env, metrics_ports=(free_port(), verify_metrics))
    yield stack, verify_metrics
    stop_process(stack.process)


@pytest.mark.parametrize("method", ["draft_model", "medusa"])
def test_verifier_killed_mid_speculative_stream_the_stream_completes_identically(colocated, method):
    # The verifier drafts and verifies round after round in one Decode stream; when it dies,
    # the gateway prefills the restarted one from its own sequence and speculates on (Medusa's
    # heads from the hidden state that prefill leaves).
    stack, verify_metrics = colocated
    speculation = {"speculation": {"method": method, "num_speculative_tokens": 3, "adaptive": False}}
    reference = greedy(stack.url, 300, speculation={"method": "none"})["choices"][0]["token_ids"]
    verify_port = stack.verify_address.rsplit(":", 1)[1]
    body = {"prompt": [7, 8, 9], "max_tokens": 300, "temperature": 0, **speculation}
    kill = lambda: os.kill(pid_of("verify_service", verify_port), signal.SIGKILL)  # noqa: E731
    assert streamed_tokens(stack.url, body, 20, kill) == reference
    after = greedy(stack.url, 40, **speculation)
    assert after["choices"][0]["token_ids"] == reference[:40] and after["usage"]["speculation"]["num_drafts"] > 0


def test_a_client_that_leaves_a_speculative_stream_frees_both_caches(colocated):
    stack, verify_metrics = colocated
    body = {"prompt": [4, 5, 6], "max_tokens": 400, "temperature": 0, "stream": True,
            "speculation": {"num_speculative_tokens": 3, "adaptive": False}}  # fmt: skip
    with httpx.Client(headers=AUTH, timeout=60) as client:
        with client.stream("POST", f"{stack.url}/v1/completions", json=body) as stream:
            next(stream.iter_lines())  # the first chunk: the request is in flight; then walk away
    deadline = time.monotonic() + 10
    names = ("specserve:verifier_kv_slots_in_use", "specserve:drafter_kv_slots_in_use")
    while any(metric(verify_metrics, name) > 0 for name in names) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [metric(verify_metrics, name) for name in names] == [0, 0]


def test_suffix_learns_across_the_requests_of_one_api_key_and_never_of_another(guarded):
    """The same prompt again drafts the target's earlier answer, for the key that asked it
    before; another key's request finds nothing of it (its tokens are not shared)."""
    stack, _ = guarded
    speculation = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}

    def accepted(key: str, prompt: list[int]) -> tuple[list[int], int]:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "return_token_ids": True,
                "speculation": speculation}  # fmt: skip
        reply = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=120).json()  # fmt: skip
        return reply["choices"][0]["token_ids"], reply["usage"]["speculation"]["num_accepted_tokens"]

    prompt = [31, 41, 59, 26, 53]
    first, kept_first = accepted(KEY, prompt)
    again, kept_again = accepted(KEY, prompt)
    other, kept_other = accepted("other-key", prompt)
    assert first == again == other
    assert kept_again > kept_first and kept_again >= 30  # the first answer, drafted again
    assert kept_other == kept_first  # as the first request: nothing of the other key's answers
