from __future__ import annotations

from dataclasses import dataclass

from gateway.clients import Deadlines
from gateway.replicas import split_addresses
from specserve.config import TracingOptions, check, field
from specserve.methods import registry
from specserve.methods.trees import TreeShape, TreeShapeError
from specserve.paths import DEMO_TARGET
from specserve.serving.tls import channel_credentials, channel_options


@dataclass(frozen=True)
class GatewayConfig(TracingOptions):
    host: str = field("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = field(8000, "HTTP port")
    draft_address: str = field(
        "",
        "a draft service: host:port, a comma-separated list of its replicas, or dns:///name:port (one address per "
        "replica); empty, the default: none, the verifier's own drafts only",
    )
    verify_address: str = field(
        "127.0.0.1:50052",
        "the verify service: host:port, a comma-separated list of its replicas, or dns:///name:port (one address per "
        "replica); each session stays on one replica",
    )
    tokenizer: str = field(str(DEMO_TARGET), "directory holding the target's tokenizer files")
    served_model_name: str = field("", "model name clients send; default: the verify service's")
    num_speculative_tokens: int = field(4, "K used when a request does not set speculation.num_speculative_tokens")
    method: str = field(
        "draft_model",
        "speculation method when a request sets none: one of specserve/methods/registry.py's, or none",
    )
    adaptive: bool = field(
        True,
        "when a request does not say: choose each round's K (0: no drafts) from the session's measured draft, "
        "verify and round costs and its acceptance, for the most tokens per second",
    )
    adaptive_k_min: int = field(
        0, "smallest K the adaptive choice takes (0: it may stop drafting where drafts do not pay)"
    )
    adaptive_k_max: int = field(8, "largest K the adaptive choice takes")
    pipeline: bool = field(False, "draft round r + 1 while round r is verified, when a request does not say")
    tree: str = field(
        "",
        "a token tree for the model methods' rounds when a request sets no speculation.tree: children per depth "
        "('2,1,1') or paths of ranks ('[[0],[0,0],[1]]'); with adaptive, each round takes the tree or a chain, "
        "whichever gives more tokens per second; empty: chains",
    )
    min_draft_probability: float = field(
        0.0, "stop drafting once the draft's top probability falls below this (0: never)"
    )
    max_speculating_requests: int = field(
        0,
        "speculate only while at most this many requests are being generated (0: no limit); beyond it requests "
        "decode target-only in stretches (16 tokens, doubling up to 256 while it lasts) and speculate again once "
        "fewer run; a sampled request with a seed keeps speculating, so that its output does not depend on the "
        "load. Speculation pays while the target's pass is bound by memory traffic; on a CPU under load it is "
        "bound by the cores (docs/benchmarks.md)",
    )
    startup_timeout_s: float = field(300.0, "how long to wait at start for the verify service to answer")
    draft_startup_wait_s: float = field(
        15.0,
        "how long to wait at start for a draft service to answer; beyond it the gateway serves its methods as "
        "target-only rounds and starts drafting once it answers",
    )
    rpc_timeout_s: float = field(60.0, "deadline of each call to the verify service")
    draft_timeout_s: float = field(5.0, "deadline of each draft proposal; a late one makes a target-only round")
    verify_retry_s: float = field(60.0, "how long an unreachable (restarting) verifier is waited for")
    draft_backoff_s: float = field(1.0, "first pause of drafting after a draft failure (doubles, up to 32x)")
    max_concurrent_requests: int = field(256, "requests generated at once; more are answered 429 with Retry-After")
    tls_ca: str = field("", "PEM CA that signed the services' certificates: talk TLS to them")
    tls_cert: str = field("", "PEM client certificate for mutual TLS with the services")
    tls_key: str = field("", "PEM private key of tls_cert")
    tls_server_name: str = field("", "name the services' certificates are checked against (default: the host dialled)")
    http_tls_cert: str = field("", "PEM certificate: serve HTTPS instead of HTTP")
    http_tls_key: str = field("", "PEM private key of http_tls_cert")
    max_body_bytes: int = field(4 * 1024 * 1024, "largest HTTP request body accepted (413 beyond)")
    api_keys: str = field(
        "",
        "comma-separated API keys; when set every route but /health and /metrics needs 'Authorization: Bearer KEY'",
    )

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(key.strip() for key in self.api_keys.split(",") if key.strip())

    @property
    def channel_security(self) -> tuple:
        """(credentials or None, channel options) for the links to both services."""
        return channel_credentials(self.tls_ca, self.tls_cert, self.tls_key), channel_options(self.tls_server_name)

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.rpc_timeout_s, self.draft_timeout_s, self.verify_retry_s, self.draft_backoff_s)

    def __post_init__(self) -> None:
        self.check_tracing()
        check(0 < self.port < 65536, f"port must lie in 1..65535, got {self.port}")
        check(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1")
        methods = (*registry.names(), registry.NONE)
        check(self.method in methods, f"method must be one of {', '.join(methods)}, got {self.method!r}")
        check(0 <= self.adaptive_k_min <= self.adaptive_k_max, "need 0 <= adaptive_k_min <= adaptive_k_max")
        check(self.adaptive_k_max >= 1, "adaptive_k_max must be >= 1")
        check(0 <= self.min_draft_probability <= 1, "min_draft_probability must lie in [0, 1]")
        if self.tree:
            try:
                TreeShape.parse(self.tree)
            except TreeShapeError as error:
                raise ValueError(f"tree: {error}") from None
        check(self.startup_timeout_s > 0, "startup_timeout_s must be > 0")
        check(self.draft_startup_wait_s >= 0, "draft_startup_wait_s must be >= 0")
        for name in ("verify_address", "draft_address"):
            address = getattr(self, name)
            if address or name == "verify_address":
                try:
                    split_addresses(address)
                except ValueError as error:
                    raise ValueError(f"{name}: {error}") from None
        check(self.rpc_timeout_s > 0, "rpc_timeout_s must be > 0")
        check(
            self.draft_timeout_s > 0 and self.verify_retry_s >= 0 and self.draft_backoff_s >= 0, "timeouts must be > 0"
        )
        check(self.max_concurrent_requests >= 1, "max_concurrent_requests must be >= 1")
        check(self.max_speculating_requests >= 0, "max_speculating_requests must be >= 0")
        check(bool(self.http_tls_cert) == bool(self.http_tls_key), "HTTPS needs both http_tls_cert and http_tls_key")
        check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
