from __future__ import annotations

from dataclasses import dataclass

from specserve.config import CPUS_HELP, TracingOptions, check, field, parse_cpus
from specserve.paths import DEMO_DRAFT


@dataclass(frozen=True)
class DraftConfig(TracingOptions):
    model: str = field(str(DEMO_DRAFT), "directory of the draft model (Hugging Face format)")
    host: str = field("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = field(50051, "gRPC port")
    device: str = field("auto", "torch device: auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: str = field("auto", "weight dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    early_exit_model: str = field("", "target model directory whose first layers serve method early_exit (empty: none)")
    early_exit_layers: int = field(2, "layers of the target the early_exit drafter runs")
    ngram_max: int = field(4, "longest suffix the ngram drafter looks up")
    support_size: int = field(32, "draft tokens are drawn from the draft's top support_size tokens, renormalised")
    max_speculative_tokens: int = field(16, "largest K accepted per request")
    max_sessions: int = field(256, "most concurrent sessions (streams); beyond it RESOURCE_EXHAUSTED")
    max_batch: int = field(64, "most draft requests processed in one batch")
    max_wait_ms: float = field(0.0, "how long a lone request waits for others to share its batch")
    matmul_dtype: str = field(
        "auto",
        "dtype of the runner's weight matrices: auto (on a CPU: int8 where it has bfloat16, else float32 for small "
        "matrices and the checkpoint's 16-bit dtype or float32 for the rest), or a dtype",
    )
    backend: str = field(
        "auto", "model backend: auto (our runner for the Llama family, else transformers), runner, transformers"
    )
    max_model_len: int = field(4096, "longest sequence served (capped by the model's own limit); sizes the KV cache")
    max_batched_tokens: int = field(2048, "most tokens in one forward; longer prompts are prefilled in chunks")
    cpus: str = field("", CPUS_HELP)
    threads: int = field(
        1,
        "torch CPU threads for the model (0: torch's default). One: a draft's matrices are small, and a "
        "second thread cost more in hand-offs than it saved",
    )
    compile_steps: bool = field(
        True,
        "torch.compile the draft model's one-token steps on a CPU (needs a C++ compiler), "
        "in the background after start-up: the eager forward serves until they are ready",
    )
    max_workers: int = field(300, "gRPC worker threads (each open stream holds one)")
    metrics_port: int = field(9101, "port of the Prometheus /metrics endpoint (0: none)")
    health_port: int = field(
        0, "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS (0: none)"
    )
    tls_cert: str = field("", "PEM certificate: serve TLS only (no plaintext)")
    tls_key: str = field("", "PEM private key of tls_cert")
    tls_client_ca: str = field("", "PEM CA: demand client certificates it signed (mutual TLS)")
    grace_s: float = field(10.0, "on SIGTERM, how long in-flight streams may take to finish")

    def __post_init__(self) -> None:
        self.check_tracing()
        check(bool(self.model), "model must name a directory")
        check(0 < self.port < 65536, f"port must lie in 1..65535, got {self.port}")
        check(self.early_exit_layers >= 1, "early_exit_layers must be >= 1")
        check(self.ngram_max >= 1, "ngram_max must be >= 1")
        check(self.support_size >= 1, "support_size must be >= 1")
        check(self.max_speculative_tokens >= 1, "max_speculative_tokens must be >= 1")
        check(self.max_sessions >= 1, "max_sessions must be >= 1")
        check(self.max_batch >= 1, "max_batch must be >= 1")
        check(self.max_wait_ms >= 0, "max_wait_ms must be >= 0")
        check(
            self.backend in ("auto", "runner", "transformers"),
            f"backend must be auto, runner or transformers, got {self.backend!r}",
        )
        check(
            self.matmul_dtype in ("auto", "float32", "bfloat16", "float16"), f"bad matmul_dtype {self.matmul_dtype!r}"
        )
        check(self.max_model_len >= 2, "max_model_len must be >= 2")
        check(self.max_batched_tokens >= 1, "max_batched_tokens must be >= 1")
        check(self.threads >= 0, "threads must be >= 0")
        parse_cpus(self.cpus)
        check(self.max_workers > self.max_sessions, "max_workers must exceed max_sessions: each stream holds a thread")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
