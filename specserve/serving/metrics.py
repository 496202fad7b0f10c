"""Prometheus metrics, named with the words of docs/design.md. Each process owns its registry
(no module-level state); the gateway serves it on /metrics, each service on a metrics port.

Counters are exposed with prometheus_client's `_total` suffix, e.g.
`specserve:spec_decode_num_drafts_total`. The gateway's /metrics also shows its families by
vLLM's names (VLLM_NAMES), for scrapers written for vLLM: the same samples, renamed at each
scrape, so each event is counted once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 steps, to 5M tokens
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for the n parameter

# vLLM's names (its v1 engine's, https://docs.vllm.ai/en/latest/design/metrics.html) for what
# the gateway measures: each a second name of one specserve: family, the same samples and
# labels. vllm:num_requests_running is derived (see GatewayMetrics.collect).
VLLM_NAMES = {
    "specserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    "specserve:prompt_tokens": ("vllm:prompt_tokens",),
    "specserve:generation_tokens": ("vllm:generation_tokens",),
    "specserve:request_success": ("vllm:request_success",),
    "specserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM 0.11 renamed time_per_output_token_seconds to inter_token_latency_seconds; both are scraped.
    "specserve:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "specserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "specserve:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "specserve:request_generation_tokens": ("vllm:request_generation_tokens",),
    "specserve:request_params_n": ("vllm:request_params_n",),
    "specserve:request_params_max_tokens": ("vllm:request_params_max_tokens",),
    "specserve:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "specserve:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "specserve:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "specserve:spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("specserve:spec_decode_num_drafts", "Rounds that carried draft tokens.", registry=r)
        self.num_draft_tokens = Counter(
            "specserve:spec_decode_num_draft_tokens", "Draft tokens sent for verification.", registry=r
        )
        self.num_accepted_tokens = Counter(
            "specserve:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            "specserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0 = the first draft token of a round).",
            ["position"],
            registry=r,
        )
        self.ttft = Histogram(
            "specserve:time_to_first_token_seconds",
            "Request arrival to first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specserve:inter_token_latency_seconds",
            "Time per output token after the first: each token of a round counts round time / tokens in the round.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specserve:e2e_request_latency_seconds",
            "Request arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "specserve:round_seconds",
            "Time of one round by hop: draft and verify calls as the gateway saw them, "
            "wire = calls minus the services' own time.",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests_running = Gauge("specserve:num_requests_running", "Requests being generated now.", registry=r)
        self.requests = Counter(
            "specserve:requests", "Finished requests, by finish reason.", ["finish_reason"], registry=r
        )
        # vLLM's names, which operators' dashboards scrape.
        self.request_success = Counter(
            "specserve:request_success",
            "Finished requests, by vLLM's finished_reason.",
            ["finished_reason"],
            registry=r,
        )
        self.requests_waiting = Gauge(
            "specserve:num_requests_waiting", "Requests not yet past their prefill (no token yet).", registry=r
        )
        self.prompt_tokens = Counter("specserve:prompt_tokens", "Prompt tokens of the requests served.", registry=r)
        self.generation_tokens = Counter("specserve:generation_tokens", "Tokens generated.", registry=r)
        self._per_request(r)
        self.model_name = ""  # every sample's model_name label, once the served model is known

    def _per_request(self, r: CollectorRegistry) -> None:
        """vLLM's histograms of each finished request: each choice of an n > 1 request counts as one,
        but for request_params_n, observed once for all n."""
        self.request_prompt_tokens = Histogram(
            "specserve:request_prompt_tokens",
            "Prompt tokens of each finished request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "specserve:request_generation_tokens",
            "Tokens each finished request generated.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_params_n = Histogram(
            "specserve:request_params_n",
            "The n parameter of each finished request (once for its n choices).",
            buckets=N_BUCKETS,
            registry=r,
        )
        self.request_params_max_tokens = Histogram(
            "specserve:request_params_max_tokens",
            "The max_tokens parameter of each finished request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )

    def observe_round(self, k: int, num_accepted: int, draft_s: float, verify_s: float, wire_s: float) -> None:
        if k > 0:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(k)
            self.num_accepted_tokens.inc(num_accepted)
            for position in range(num_accepted):
                self.accepted_per_pos.labels(position=str(position)).inc()
            self.round_seconds.labels(hop="draft").observe(draft_s)
        self.round_seconds.labels(hop="verify").observe(verify_s)
        self.round_seconds.labels(hop="wire").observe(wire_s)

    def exposition(self) -> bytes:
        """The registry's samples, each labelled with model_name (vLLM's label), also by vLLM's names."""
        return generate_latest(self)

    def collect(self):
        """A collector (of generate_latest): the registry's families, every sample labelled
        model_name; each family in VLLM_NAMES again by its vLLM names; and
        vllm:num_requests_running, the requests past their first token (specserve's running
        count holds the waiting ones too; vLLM's running and waiting add up to those in flight)."""
        gauges = {}
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, "model_name": self.model_name}) for s in family.samples]
            yield family
            for name in VLLM_NAMES.get(family.name, ()):
                yield _renamed(family, name)
            if family.type == "gauge" and family.samples:
                gauges[family.name] = family.samples[0].value
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Requests past their first token, still generating "
            "(specserve:num_requests_running less specserve:num_requests_waiting).",
            labels=["model_name"],
        )
        running.add_metric(
            [self.model_name], gauges["specserve:num_requests_running"] - gauges["specserve:num_requests_waiting"]
        )
        yield running


def _renamed(family: Metric, name: str) -> Metric:
    """family's samples under another family name (its suffixes, labels and values as they are)."""
    renamed = Metric(name, f"{family.documentation} (the samples of {family.name})", family.type)
    renamed.samples = [s._replace(name=name + s.name[len(family.name) :]) for s in family.samples]
    return renamed


class ServiceMetrics:
    """What the draft and verify services report: batching and occupancy."""

    def __init__(self, component: str, registry: CollectorRegistry | None = None) -> None:
        """registry: another component's, where one process reports both (colocated drafting)."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram(
            f"specserve:{component}_batch_size", "Sessions per batch (one forward).", buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            f"specserve:{component}_queue_seconds",
            "Time a call waited for its batch to start.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            f"specserve:{component}_forward_seconds",
            "Time of one batched forward.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            f"specserve:{component}_queue_depth",
            "Calls waiting for a batch (what the verifier autoscales on).",
            registry=r,
        )
        self.active_sessions = Gauge(f"specserve:{component}_active_sessions", "Sessions held now.", registry=r)
        self.kv_slots_in_use = Gauge(f"specserve:{component}_kv_slots_in_use", "KV-cache slots in use.", registry=r)
        self.kv_cache_usage = Gauge(
            f"specserve:{component}_kv_cache_usage_perc", "KV-cache slots in use, as a fraction (vLLM's).", registry=r
        )
        self.prefills = Counter(  # counted by the verifier
            f"specserve:{component}_prefills",
            "Sessions prefilled (a new request, or one prefilled again: moved from another replica, or out of step).",
            registry=r,
        )

    def measure_kv_cache(self, backends: list) -> None:
        """kv_cache_usage_perc from these backends' slots, read at each scrape."""
        self.kv_cache_usage.set_function(
            lambda: sum(b.in_use for b in backends) / max(1, sum(b.capacity for b in backends))
        )

    def serve(self, host: str, port: int) -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)

    def count_compiling(self, models: dict) -> None:
        """specserve:drafter_compiling_steps: how many of these models (a drafter's) are
        building compiled steps (at start-up) or greedy or sampled runs (when first asked for), their
        eager forward or one-token steps serving meanwhile."""
        compiling = Gauge(
            "specserve:drafter_compiling_steps",
            "Draft models building compiled steps or greedy or sampled runs "
            "(the eager forward or one-token steps serve meanwhile).",
            registry=self.registry,
        )
        compiling.set_function(lambda: sum(m.backend.compiling for m in models.values()))
