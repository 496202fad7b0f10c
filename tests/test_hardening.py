"""Hostile input never gets a 5xx or a dropped connection, abandoned requests free their
sessions at once, a draft outage degrades to target-only rounds, and a session stays on its
verifier replica."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specserve.tools.fuzz import Tally, fuzz_hostile
from tests.conftest import free_port, metric, start_stack, stop_process, wait_until_healthy

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[3 + i, 40 + 7 * i, 90 + i, 17] for i in range(16)]


# A chat template that refuses roles it does not know, as many models' templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def keyed(tiny_pair, tmp_path_factory):
    """The stack with an API key, on the tiny target with a strict chat template."""
    target, draft = tiny_pair
    strict = tmp_path_factory.mktemp("strict") / "target"
    shutil.copytree(target, strict)
    config_path = strict / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": STRICT_TEMPLATE}))
    stack = start_stack(strict, draft, env={"SPECSERVE_GATEWAY_API_KEYS": KEY})
    yield stack
    stop_process(stack.process)


def test_hostile_requests_get_4xx_never_a_5xx_or_a_dropped_connection(keyed):
    tally = Tally()
    fuzz_hostile(keyed.url, tally, KEY)
    assert tally.inputs >= 500 and not tally.failures, tally.failures[:5]
    # Still serving: greedy and past EOS, so the count cannot fall short by chance (a sampled
    # request ends at a sampled EOS about once in a thousand on the tiny target).
    body = {"prompt": "ok", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{keyed.url}/v1/completions", json=body, headers=AUTH)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 1e300}, "temperature"),
        ({"top_p": 1e-300}, "top_p"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"min_p": -0.1}, "min_p"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"guided_regex": "(a|"}, "guided_regex"),
        ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"json": {}, "disable_additional_properties": True}}, "structured_outputs"),
    ],
)
def test_a_parameter_out_of_range_or_not_supported_is_a_400_that_names_it(keyed, fields, param):
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    reply = httpx.post(f"{keyed.url}/v1/completions", json=body, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert param in reply.json()["error"]["message"]


def test_neutral_values_of_unsupported_parameters_and_a_huge_top_k_are_served(keyed):
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "presence_penalty": 0,
        "logit_bias": {},
        "tools": [],
        "top_k": 2**40,
        "response_format": {"type": "text"},
        "user": "someone",
        "temperature": 0,
    }
    reply = httpx.post(f"{keyed.url}/v1/completions", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text


def test_odd_headers_roles_and_bodies_get_their_4xx(keyed):
    url = f"{keyed.url}/v1/completions"
    body = b'{"prompt": "hi", "max_tokens": 2}'
    reply = httpx.post(url, content=body, headers={"content-type": "application/json", "authorization": b"Bearer \xff"})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert reply.headers["x-request-id"]
    chat = {"messages": [{"role": "narrator", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{keyed.url}/v1/chat/completions", json=chat, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    assert "unknown role narrator" in reply.json()["error"]["message"]
    chat["messages"][0]["role"] = "user"
    assert httpx.post(f"{keyed.url}/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
    variables = {**chat, "chat_template_kwargs": {"enable_thinking": False}}  # a template's own variable
    assert httpx.post(f"{keyed.url}/v1/chat/completions", json=variables, headers=AUTH).status_code == 200
    variables["chat_template_kwargs"] = {"tokenize": True}  # one of the call's own arguments
    reply = httpx.post(f"{keyed.url}/v1/chat/completions", json=variables, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template_kwargs"

    def chunks(total: int):  # a body sent chunked: no Content-Length to refuse it by
        yield b'{"prompt": "'
        for start in range(0, total, 65536):
            yield b"a" * min(65536, total - start)
        yield b'", "max_tokens": 2}'

    reply = httpx.post(url, content=chunks(5 * 1024 * 1024), headers={"content-type": "application/json", **AUTH})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
    reply = httpx.post(url, content=chunks(100), headers={"content-type": "application/json", **AUTH})
    assert reply.status_code == 200, reply.text
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200  # Prometheus scrapes without a key
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401


def test_health_answers_within_a_second_while_a_4_mib_prompt_is_tokenized(keyed):
    prompt = ("def f(x): return x * 2  # some words " * 120_000)[: 4 * 1024 * 1024 - 200]  # no escapes in JSON
    latencies, done = [], threading.Event()

    def probe():
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                started = time.perf_counter()
                assert client.get(f"{keyed.url}/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        reply = httpx.post(
            f"{keyed.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=AUTH, timeout=120
        )
    finally:
        done.set()
        prober.join()
    assert reply.status_code == 400 and "maximum context length" in reply.json()["error"]["message"]
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_abandoned_streams_and_plain_requests_free_their_slots_with_the_default_ttl(request, stack_name):
    """4 streams read one chunk and closed, 4 plain requests whose client timed out: 3 s
    later no KV slot is held in either service (the sessions' TTL is its default, 600 s)."""
    stack = request.getfixturevalue(stack_name)
    draft_metrics, verify_metrics = stack.metrics_ports
    body = {"prompt": [5, 6, 7], "max_tokens": 480, "temperature": 0, "speculation": {"adaptive": False}}
    names = [
        (verify_metrics, "specserve:verifier_kv_slots_in_use"),
        (draft_metrics if stack.draft_address else verify_metrics, "specserve:drafter_kv_slots_in_use"),
    ]
    # Sessions other tests left on this shared stack on purpose (the gRPC fuzzer's prefills,
    # held until their TTL) are not this test's: what these requests hold is counted.
    before = [metric(port, name) for port, name in names]

    def stream(_):
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{stack.url}/v1/completions", json={**body, "stream": True}) as reply:
                next(reply.iter_lines())

    def plain(_):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{stack.url}/v1/completions", json=body, timeout=0.3)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda job: job(None), [stream] * 4 + [plain] * 4))
    time.sleep(3)
    held = [metric(port, name) - b for (port, name), b in zip(names, before)]
    assert held == [0, 0]


def _service(module: str, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "SPECSERVE_LOG_LEVEL": "WARNING",
        "SPECSERVE_VERIFY_THREADS": "1",
        "SPECSERVE_DRAFT_THREADS": "1",
        "SPECSERVE_DRAFT_COMPILE_STEPS": "0",
        "SPECSERVE_VERIFY_COMPILE_STEPS": "0",
    }
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


@pytest.fixture(scope="module")
def replicas(tiny_pair):
    """Two verifier replicas and a gateway given both, and a draft service's address where
    none answers yet (the tests start it)."""
    target, draft = tiny_pair
    ports = {name: free_port() for name in ("a", "b", "a_metrics", "b_metrics", "draft", "draft_metrics", "http")}
    processes = {
        name: _service(
            "verify_service",
            "--model",
            str(target),
            "--port",
            str(ports[name]),
            "--device",
            "cpu",
            "--metrics-port",
            str(ports[f"{name}_metrics"]),
        )
        for name in ("a", "b")
    }
    verify_address = f"127.0.0.1:{ports['a']},127.0.0.1:{ports['b']}"
    processes["gateway"] = _service(
        "gateway",
        "--port",
        str(ports["http"]),
        "--tokenizer",
        str(target),
        "--verify-address",
        verify_address,
        "--draft-address",
        f"127.0.0.1:{ports['draft']}",
        "--draft-startup-wait-s",
        "1",
    )
    url = f"http://127.0.0.1:{ports['http']}"

    def start_draft():
        if "draft" not in processes:
            processes["draft"] = _service(
                "draft_service",
                "--model",
                str(draft),
                "--port",
                str(ports["draft"]),
                "--device",
                "cpu",
                "--metrics-port",
                str(ports["draft_metrics"]),
            )

    try:
        wait_until_healthy(url, processes["gateway"])
        yield url, ports, processes, start_draft
    finally:
        for process in processes.values():
            stop_process(process)


def _greedy(url: str, prompt: list[int], method: str) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
        "speculation": {"method": method},
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _references(stack) -> list[list[int]]:
    return [_greedy(stack.url, p, "none")["choices"][0]["token_ids"] for p in PROMPTS]


def test_a_gateway_whose_draft_service_is_down_serves_target_only_then_drafts_once_it_answers(replicas, stack):
    url, ports, processes, start_draft = replicas
    if "draft" in processes:
        pytest.skip("the draft service is already up")
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and set(health["draft"].values()) == {"unavailable"}
    reference = _greedy(stack.url, PROMPTS[0], "none")["choices"][0]["token_ids"]
    served = _greedy(url, PROMPTS[0], "draft_model")
    assert served["choices"][0]["token_ids"] == reference and served["usage"]["speculation"]["num_drafts"] == 0
    start_draft()
    deadline = time.monotonic() + 120
    while _greedy(url, PROMPTS[0], "draft_model")["usage"]["speculation"]["num_drafts"] == 0:
        assert time.monotonic() < deadline, "the gateway did not start drafting"
        time.sleep(0.5)
    assert set(httpx.get(f"{url}/health").json()["draft"].values()) == {"serving"}


def test_sessions_stay_on_their_verifier_replica_and_move_only_when_it_is_gone(replicas, stack):
    url, ports, processes, start_draft = replicas
    start_draft()
    references = _references(stack)
    prefills = lambda: [metric(ports[f"{n}_metrics"], "specserve:verifier_prefills_total") for n in "ab"]  # noqa: E731
    before = prefills()
    jobs = [(p, method) for p in range(len(PROMPTS)) for method in ("draft_model", "none")]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda job: _greedy(url, PROMPTS[job[0]], job[1]), jobs))
    assert [r["choices"][0]["token_ids"] for r in replies] == [references[p] for p, _ in jobs]
    assert sum(r["usage"]["speculation"]["num_drafts"] for r in replies) > 0
    made = [after - b for after, b in zip(prefills(), before)]
    assert all(n > 0 for n in made) and sum(made) == len(jobs), made  # both replicas; one prefill per request
    stop_process(processes.pop("b"))  # a replica goes away: its sessions go to the other
    replies = [_greedy(url, PROMPTS[p], "draft_model") for p in range(8)]
    assert [r["choices"][0]["token_ids"] for r in replies] == references[:8]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
