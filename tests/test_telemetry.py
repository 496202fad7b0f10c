"""One request is one trace across the processes; /metrics agrees with usage."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe import RequestObserver
from gateway.rounds import GenerationPlan
from specserve.sampling import SamplingParams
from specserve.serving.metrics import VLLM_NAMES, GatewayMetrics
from specserve.tools.trace_report import DRAFT_CLIENT, ROUND, SpanCollector, duration_ms, report
from tests.conftest import free_port, start_stack, stop_process


def _traced_stack(tiny_pair, draft_service: bool):
    collector = SpanCollector(f"127.0.0.1:{free_port()}").start()
    verify_metrics, draft_metrics = free_port(), free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    stack = start_stack(*tiny_pair, env=env, metrics_ports=(draft_metrics, verify_metrics), draft_service=draft_service)
    return stack, collector, verify_metrics, draft_metrics


@pytest.fixture(scope="module")
def traced(tiny_pair):
    """The stack with a draft service: three processes."""
    stack, collector, verify_metrics, draft_metrics = _traced_stack(tiny_pair, draft_service=True)
    yield stack, collector, verify_metrics, draft_metrics
    stop_process(stack.process)
    collector.stop()


@pytest.fixture(scope="module")
def traced_colocated(tiny_pair):
    """The stack as `specserve up` starts it: the verifier drafts for itself."""
    stack, collector, verify_metrics, _ = _traced_stack(tiny_pair, draft_service=False)
    yield stack, collector, verify_metrics
    stop_process(stack.process)
    collector.stop()


def wait_for_trace(collector: SpanCollector, rounds: int, timeout_s: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = collector.snapshot()
        requests = [s for s in spans if s["attributes"].get("gen_ai.operation.name")]
        if requests:
            trace = [s for s in spans if s["trace_id"] == requests[0]["trace_id"]]
            services = {s["service"] for s in trace}
            if len([s for s in trace if s["name"] == ROUND]) >= rounds and len(services) == 3:
                time.sleep(0.5)  # stragglers of the same trace
                return [s for s in collector.snapshot() if s["trace_id"] == requests[0]["trace_id"]]
        time.sleep(0.2)
    raise TimeoutError(f"no complete trace; got {[(s['service'], s['name']) for s in collector.snapshot()]}")


def test_one_request_is_one_trace_across_all_three_processes(traced, tmp_path):
    stack, collector, _, _ = traced
    # A fixed K: an adaptive request's target-only stretches would add Decode calls to the trace.
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "temperature": 0,
        "speculation": {"num_speculative_tokens": 3, "adaptive": False},
    }
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()
    httpx.get(f"{stack.url}/health")  # health checks must not appear in any trace
    rounds = reply["usage"]["speculation"]["num_drafts"]
    spans = wait_for_trace(collector, rounds)
    by_id = {s["span_id"]: s for s in spans}
    assert {s["service"] for s in spans} == {"specserve-gateway", "specserve-draft", "specserve-verify"}
    assert not any("Health" in s["name"] or "/health" in s["name"] for s in collector.snapshot())

    [request] = [s for s in spans if s["attributes"].get("gen_ai.operation.name")]
    assert request["service"] == "specserve-gateway"
    assert len([s for s in spans if s["parent_span_id"] == ""]) == 1  # a single root: the HTTP request
    assert request["attributes"]["gen_ai.request.model"] == "target"
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 12
    assert request["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    for span in spans:  # every parent is in the same trace
        assert span["parent_span_id"] == "" or span["parent_span_id"] in by_id, span["name"]

    round_spans = [s for s in spans if s["name"] == ROUND]
    assert all(by_id[s["parent_span_id"]] is request for s in round_spans)
    hops_ms = []
    for round_span in round_spans:
        calls = [s for s in spans if s["parent_span_id"] == round_span["span_id"]]
        names = {c["name"] for c in calls}
        assert DRAFT_CLIENT in names and any(n.endswith("VerifyService/Verify") for n in names), names
        for call in calls:  # each client span has the service's server span under it
            servers = [s for s in spans if s["parent_span_id"] == call["span_id"]]
            assert servers and servers[0]["service"] != "specserve-gateway"
            assert servers[0]["attributes"]["rpc.system"] == "grpc"
        hops_ms.append(sum(duration_ms(c) for c in calls))
        assert hops_ms[-1] <= duration_ms(round_span)  # one call after the other, inside the round
        assert {"specserve.k", "specserve.num_accepted", "specserve.batch_size"} <= set(round_span["attributes"])
    # The hops account for the rounds' time to within 10%, over the request: on a busy two-core
    # machine one 9 ms round was once 1.2 ms (13%) more than its calls, the gateway's own share.
    rounds_ms = sum(duration_ms(s) for s in round_spans)
    assert sum(hops_ms) >= 0.90 * rounds_ms, (hops_ms, rounds_ms)
    names = {s["name"] for s in spans}
    assert {"verifier.queue", "target.forward", "kernel.rejection_sample", "draft.forward"} <= names

    text = report(spans, tmp_path)
    assert (
        "| hop |" in text
        and (tmp_path / "waterfall.png").stat().st_size > 0
        and (tmp_path / "round_split.png").is_file()
    )


def test_a_target_only_request_traces_its_decode_stream_token_by_token(traced):
    stack, collector, _, _ = traced
    body = {"prompt": [5, 6, 8], "max_tokens": 12, "temperature": 0, "speculation": {"method": "none"}}
    assert httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 12
    deadline = time.monotonic() + 30
    while True:
        spans = collector.snapshot()
        decodes = [
            s for s in spans if s["name"].endswith("VerifyService/Decode") and s["service"] == "specserve-gateway"
        ]
        trace = [s for s in spans if decodes and s["trace_id"] == decodes[0]["trace_id"]]
        if len([s for s in trace if s["name"] == "target.forward"]) >= 12 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    by_id = {s["span_id"]: s for s in trace}
    [client] = decodes
    [request] = [s for s in trace if s["attributes"].get("gen_ai.operation.name")]
    assert client["parent_span_id"] == request["span_id"]
    [server] = [s for s in trace if s["parent_span_id"] == client["span_id"]]
    assert server["service"] == "specserve-verify" and server["attributes"]["rpc.grpc.status_code"] == 0
    forwards = [s for s in trace if s["name"] == "target.forward"]
    # One forward for the prefill (under its own call), one per decoded token under the stream.
    assert len([f for f in forwards if f["parent_span_id"] == server["span_id"]]) == 11
    assert all(f["parent_span_id"] in by_id for f in forwards)
    assert duration_ms(client) >= sum(duration_ms(f) for f in forwards if f["parent_span_id"] == server["span_id"])


def counter(text: str, name: str) -> float:
    """An unlabelled metric's value but for the gateway's model_name label."""
    match = re.search(rf'^{re.escape(name)}(?:{{model_name="[^"]*"}})? (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_agree_with_the_usage_served(traced):
    stack, _, verify_metrics, draft_metrics = traced
    before = httpx.get(f"{stack.url}/metrics").text
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for seed in range(3):
        body = {"prompt": [9, seed], "max_tokens": 10, "temperature": 0.8, "seed": seed, "return_timings": True}
        usage = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["usage"]["speculation"]
        for key in totals:
            totals[key] += usage[key]
    after = httpx.get(f"{stack.url}/metrics").text
    for key, value in totals.items():
        name = f"specserve:spec_decode_{key}_total"
        assert counter(after, name) - counter(before, name) == value, name
    assert "specserve:time_to_first_token_seconds_bucket" in after
    assert re.search(r'^specserve:round_seconds_count\{hop="verify",model_name="[^"]+"\}', after, re.MULTILINE)
    # vLLM's names and labels, which operators scrape
    tokens = counter(after, "specserve:generation_tokens_total") - counter(before, "specserve:generation_tokens_total")
    assert (
        tokens == 30
        and counter(after, "specserve:prompt_tokens_total") - counter(before, "specserve:prompt_tokens_total") == 6
    )
    assert counter(after, "specserve:num_requests_waiting") == 0
    assert re.search(r'^specserve:request_success_total\{finished_reason="length",model_name="[^"]+"\} ', after, re.M)
    assert 'le="600.0"' in after  # buckets past a minute, for long generations
    verifier = httpx.get(f"http://127.0.0.1:{verify_metrics}/metrics").text
    assert "specserve:verifier_batch_size_bucket" in verifier and "specserve:verifier_kv_slots_in_use" in verifier
    assert 0 <= counter(verifier, "specserve:verifier_kv_cache_usage_perc") <= 1
    assert "specserve:drafter_batch_size_bucket" in httpx.get(f"http://127.0.0.1:{draft_metrics}/metrics").text


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition, by name and labels, read as vLLM's own test reads it."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    """A sample's growth between two scrapes, its labels given but for model_name."""
    [key] = [k for k in after if k[0] == name and {n: v for n, v in k[1] if n != "model_name"} == labels]
    return after[key] - before.get(key, 0.0)


def family(scrape: dict, name: str) -> dict[tuple[str, frozenset], float]:
    """A family's samples in a scrape, by suffix (_total, _bucket, ...) and labels."""
    suffixes = ("", "_total", "_created", "_bucket", "_count", "_sum")
    return {(n[len(name) :], labels): v for (n, labels), v in scrape.items() if n in {name + s for s in suffixes}}


def test_the_gateway_shows_vllms_names_with_the_values_of_specserves(traced):
    """A scraper written for vLLM (its tests/entrypoints/openai/test_metrics.py) finds its
    names on the gateway's /metrics: the specserve: samples again, each labelled model_name."""
    stack, _, _, _ = traced
    before = samples(httpx.get(f"{stack.url}/metrics").text)
    usages, requests, max_tokens = [], 3, 10
    for seed in range(requests):
        body = {
            "prompt": [11, seed, 3],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": seed,
            "speculation": {"num_speculative_tokens": 3},
        }
        usages.append(httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["usage"])
    text = httpx.get(f"{stack.url}/metrics").text
    after = samples(text)
    vllm = {key: value for key, value in after.items() if key[0].startswith("vllm:")}
    assert vllm and all(dict(labels)["model_name"] == "target" for _, labels in vllm)
    for specserve_name, names in VLLM_NAMES.items():  # the same samples under each name
        for name in names:
            assert family(after, name) == family(after, specserve_name) != {}, name
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert delta(before, after, "vllm:prompt_tokens_total") == prompt == requests * 3
    assert delta(before, after, "vllm:generation_tokens_total") == generated == requests * max_tokens
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == requests
    for name, total in (
        ("request_prompt_tokens", prompt),
        ("request_generation_tokens", generated),
        ("request_params_max_tokens", requests * max_tokens),
        ("request_params_n", requests),
    ):
        assert delta(before, after, f"vllm:{name}_count") == requests, name
        assert delta(before, after, f"vllm:{name}_sum") == total, name
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(before, after, f"vllm:{name}_count") == requests, name
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):  # every token after the first
        assert delta(before, after, f"vllm:{name}_count") == generated - requests, name
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        name = f"vllm:spec_decode_{key}_total"
        assert delta(before, after, name) == sum(u["speculation"][key] for u in usages), name
    per_position = [k for k in after if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sum(after[k] - before.get(k, 0.0) for k in per_position) == sum(
        u["speculation"]["num_accepted_tokens"] for u in usages
    )
    assert counter(text, "vllm:num_requests_running") == 0 and counter(text, "vllm:num_requests_waiting") == 0
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:request_params_n_bucket",
        "vllm:time_per_output_token_seconds_sum",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name


def _plan(prompt_length: int, max_tokens: int) -> GenerationPlan:
    return GenerationPlan(list(range(prompt_length)), max_tokens, SamplingParams(), "draft_model", 3)


def test_vllms_running_and_waiting_add_up_to_the_requests_in_flight():
    """vLLM's running requests are those past their prefill: specserve's running count less
    its waiting ones; n counts once for a request, its other histograms each choice."""
    metrics = GatewayMetrics()
    metrics.model_name = "m"

    def gauges() -> tuple[float, float]:
        text = metrics.exposition().decode()
        return counter(text, "vllm:num_requests_running"), counter(text, "vllm:num_requests_waiting")

    assert gauges() == (0, 0)
    first = RequestObserver(metrics, False, "m", _plan(4, 8), n=2)
    second = RequestObserver(metrics, False, "m", _plan(4, 8), n=0)  # the request's second choice
    assert gauges() == (0, 2)
    first.on_tokens(1)
    assert gauges() == (1, 1)
    first.finish(8, "length")
    second.finish(0, None, asyncio.CancelledError())  # its client left
    assert gauges() == (0, 0)
    failed = RequestObserver(metrics, True, "m", _plan(2, 5))
    failed.finish(0, None, RuntimeError("the verifier failed"))
    after = samples(metrics.exposition().decode())
    assert delta({}, after, "vllm:request_params_n_count") == 2 and delta({}, after, "vllm:request_params_n_sum") == 3
    assert delta({}, after, "vllm:request_prompt_tokens_sum") == 10
    assert delta({}, after, "vllm:request_params_max_tokens_sum") == 21
    for reason in ("length", "abort", "error"):
        assert delta({}, after, "vllm:request_success_total", finished_reason=reason) == 1, reason


def test_a_request_whose_rounds_the_verifier_drafts_is_one_trace_round_by_round(traced_colocated):
    """The gateway's request, its Decode call, the verifier's server span, and under it each
    round's drafting, target forward and decision; the drafter's metrics on the verifier's port."""
    stack, collector, verify_metrics = traced_colocated
    body = {
        "prompt": [5, 6, 9],
        "max_tokens": 16,
        "temperature": 0,
        "return_timings": True,
        "speculation": {"num_speculative_tokens": 3, "adaptive": False},
    }
    usage = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["usage"]
    rounds = usage["timings"]["rounds"]
    assert usage["speculation"]["num_drafts"] == rounds and usage["timings"]["rounds_by_k"].get("3", 0) >= 1
    deadline = time.monotonic() + 30
    while True:
        spans = collector.snapshot()
        requests = [s for s in spans if s["attributes"].get("gen_ai.operation.name")]
        trace = [s for s in spans if requests and s["trace_id"] == requests[0]["trace_id"]]
        if len([s for s in trace if s["name"] == "draft.forward"]) >= rounds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s["service"] for s in trace} == {"specserve-gateway", "specserve-verify"}
    [client] = [s for s in trace if s["name"].endswith("VerifyService/Decode") and s["service"] == "specserve-gateway"]
    [server] = [s for s in trace if s["parent_span_id"] == client["span_id"]]
    under = [s for s in trace if s["parent_span_id"] == server["span_id"]]
    for name in ("draft.forward", "target.forward", "kernel.rejection_sample"):
        assert len([s for s in under if s["name"] == name]) == rounds, name
    assert all(1 <= s["attributes"]["specserve.k"] <= 3 for s in under if s["name"] == "draft.forward")
    verifier = httpx.get(f"http://127.0.0.1:{verify_metrics}/metrics").text
    assert "specserve:drafter_batch_size_bucket" in verifier and "specserve:verifier_batch_size_bucket" in verifier
    assert "specserve:drafter_compiling_steps 0.0" in verifier


def test_a_medusa_request_beside_a_draft_service_is_one_decode_call_and_no_draft_span(traced):
    """Medusa's rounds run in the verifier even where a draft service drafts the other
    methods: one Decode call, the heads' drafting, the target's forward and the decision of
    each round under its server span, and nothing from the draft service."""
    stack, collector, _, _ = traced
    body = {
        "prompt": [5, 6, 10],
        "max_tokens": 16,
        "temperature": 0,
        "return_timings": True,
        "speculation": {"method": "medusa", "num_speculative_tokens": 3, "adaptive": False},
    }
    usage = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["usage"]
    rounds = usage["timings"]["rounds"]
    assert usage["speculation"]["num_drafts"] >= 1
    deadline = time.monotonic() + 30
    while True:
        spans = collector.snapshot()
        requests = [s for s in spans if s["attributes"].get("specserve.speculation.method") == "medusa"]
        trace = [s for s in spans if requests and s["trace_id"] == requests[0]["trace_id"]]
        if len([s for s in trace if s["name"] == "kernel.rejection_sample"]) >= rounds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s["service"] for s in trace} == {"specserve-gateway", "specserve-verify"}
    assert not [s for s in trace if s["name"] == DRAFT_CLIENT]
    [client] = [s for s in trace if s["name"].endswith("VerifyService/Decode") and s["service"] == "specserve-gateway"]
    [server] = [s for s in trace if s["parent_span_id"] == client["span_id"]]
    under = [s for s in trace if s["parent_span_id"] == server["span_id"]]
    for name in ("target.forward", "kernel.rejection_sample"):
        assert len([s for s in under if s["name"] == name]) == rounds, name
    assert 1 <= len([s for s in under if s["name"] == "draft.forward"]) <= rounds
