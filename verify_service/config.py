from __future__ import annotations

from dataclasses import dataclass

from specserve.config import CPUS_HELP, TracingOptions, check, field, parse_cpus
from specserve.paths import DEMO_TARGET


@dataclass(frozen=True)
class VerifyConfig(TracingOptions):
    model: str = field(str(DEMO_TARGET), "directory of the target model (Hugging Face format)")
    served_model_name: str = field("", "name clients use for the model; default: the directory's name")
    host: str = field("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = field(50052, "gRPC port")
    device: str = field("auto", "torch device: auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: str = field("auto", "weight dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    max_sessions: int = field(256, "most sessions (target KV caches) held at once; beyond it RESOURCE_EXHAUSTED")
    max_speculative_tokens: int = field(16, "largest K accepted per Verify call")
    session_ttl_s: float = field(600.0, "sessions idle this long are released (their gateway may be gone)")
    max_support: int = field(1024, "largest sparse draft-distribution support accepted per position")
    max_batch: int = field(64, "most calls verified in one batch")
    max_wait_ms: float = field(
        0.0,
        "how long a lone call waits for others to share its batch (calls that arrive during a batch join the next one anyway)",
    )
    matmul_dtype: str = field(
        "auto",
        "dtype of the runner's weight matrices: auto (a 16-bit checkpoint on CPU: bfloat16 where the CPU has it, "
        "else float32; a colocated draft's: int8 where the CPU has bfloat16), or a dtype for both",
    )
    backend: str = field(
        "auto", "model backend: auto (our runner for the Llama family, else transformers), runner, transformers"
    )
    max_model_len: int = field(4096, "longest sequence served (capped by the model's own limit); sizes the KV cache")
    max_batched_tokens: int = field(2048, "most tokens in one forward; longer prompts are prefilled in chunks")
    cpus: str = field("", CPUS_HELP)
    threads: int = field(0, "torch CPU threads for the model (0: torch's default)")
    compile_steps: bool = field(
        True,
        "torch.compile the target's decode and verify forwards on a CPU (needs a C++ compiler) before serving: "
        "start-up takes about half a minute longer; a colocated draft's steps compile in the background",
    )
    draft_model: str = field(
        "",
        "directory of a draft model the verifier runs itself (colocated drafting): requests with method "
        "draft_model then decode round after round inside the verifier, no call per round (empty: none)",
    )
    early_exit_layers: int = field(
        0, "serve method early_exit here from the target's own first layers (0: not served here)"
    )
    ngram_max: int = field(4, "longest suffix the colocated ngram drafter looks up")
    support_size: int = field(32, "colocated draft tokens are drawn from the draft's top support_size tokens")
    max_workers: int = field(
        300, "gRPC worker threads (concurrent calls in flight; each Decode stream holds one while it lasts)"
    )
    metrics_port: int = field(9102, "port of the Prometheus /metrics endpoint (0: none)")
    health_port: int = field(
        0, "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS (0: none)"
    )
    tls_cert: str = field("", "PEM certificate: serve TLS only (no plaintext)")
    tls_key: str = field("", "PEM private key of tls_cert")
    tls_client_ca: str = field("", "PEM CA: demand client certificates it signed (mutual TLS)")
    grace_s: float = field(10.0, "on SIGTERM, how long in-flight calls may take to finish")

    def __post_init__(self) -> None:
        self.check_tracing()
        check(bool(self.model), "model must name a directory")
        check(0 < self.port < 65536, f"port must lie in 1..65535, got {self.port}")
        check(self.max_sessions >= 1, "max_sessions must be >= 1")
        check(self.max_speculative_tokens >= 1, "max_speculative_tokens must be >= 1")
        check(self.session_ttl_s > 0, "session_ttl_s must be > 0")
        check(self.max_support >= 1, "max_support must be >= 1")
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
        check(self.early_exit_layers >= 0, "early_exit_layers must be >= 0")
        check(self.ngram_max >= 1, "ngram_max must be >= 1")
        check(self.support_size >= 1, "support_size must be >= 1")
        parse_cpus(self.cpus)
        check(self.max_workers >= 4, "max_workers must be >= 4")
        check(
            self.max_workers > self.max_sessions,
            "max_workers must exceed max_sessions: a Decode stream holds a thread, and other calls need some",
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
