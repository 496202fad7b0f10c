"""The options every model service takes (the draft and the verify service), with their
checks, and the drafter's (both services draft: the draft service for the gateway's rounds,
the verifier for its own); each service's config adds its own."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import CPUS_HELP, TracingOptions, check, field, parse_cpus


@dataclass(frozen=True)
class DrafterOptions:
    """How the drafter (specserve/drafting.py) drafts, alike in both services."""

    ngram_max: int = field(4, "longest suffix the ngram drafter looks up")
    copy_min_ngram: int = field(
        2,
        "a model's drafts start with a copy of what followed where the sequence's last copy_min_ngram "
        "(or more) tokens occurred before, while such copies hold the target's tokens at least as often as "
        "the model's drafts, and the model drafts the rest (0: never copy; the verifier's Medusa rounds copy "
        "after any repeated token unless 0)",
    )
    process_draft_logits: bool = field(
        False,
        "apply a request's logits processing (penalties, biases, masks) to the draft's own logits as to the "
        "target's: more drafts hold where the draft's logits are scaled like the target's; the demo draft's are "
        "flatter, and kept fewer with it (docs/benchmarks.md). Exact either way",
    )
    support_size: int = field(
        32, "sampled draft tokens are drawn from the draft's top support_size tokens, renormalised"
    )

    def check_drafter(self) -> None:
        check(self.ngram_max >= 1, "ngram_max must be >= 1")
        check(self.copy_min_ngram >= 0, "copy_min_ngram must be >= 0 (0: never copy)")
        check(self.support_size >= 1, "support_size must be >= 1")


@dataclass(frozen=True)
class ServiceOptions(TracingOptions, DrafterOptions):
    host: str = field("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    device: str = field("auto", "torch device: auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: str = field("auto", "weight dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    backend: str = field(
        "auto", "model backend: auto (our runner for the Llama family, else transformers), runner, transformers"
    )
    max_model_len: int = field(4096, "longest sequence served (capped by the model's own limit); sizes the KV cache")
    max_batched_tokens: int = field(2048, "most tokens in one forward; longer prompts are prefilled in chunks")
    cpus: str = field("", CPUS_HELP)
    health_port: int = field(
        0, "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS (0: none)"
    )
    tls_cert: str = field("", "PEM certificate: serve TLS only (no plaintext)")
    tls_key: str = field("", "PEM private key of tls_cert")
    tls_client_ca: str = field("", "PEM CA: demand client certificates it signed (mutual TLS)")

    def check_service(self) -> None:
        """The checks of what both services take (each config defines model, port, the batch
        and session bounds, matmul_dtype and threads)."""
        self.check_tracing()
        self.check_drafter()
        check(bool(self.model), "model must name a directory")
        check(0 < self.port < 65536, f"port must lie in 1..65535, got {self.port}")
        check(self.max_sessions >= 1, "max_sessions must be >= 1")
        check(self.max_speculative_tokens >= 1, "max_speculative_tokens must be >= 1")
        check(self.max_batch >= 1, "max_batch must be >= 1")
        check(self.max_wait_ms >= 0, "max_wait_ms must be >= 0")
        check(
            self.backend in ("auto", "runner", "transformers"),
            f"backend must be auto, runner or transformers, got {self.backend!r}",
        )
        check(
            self.matmul_dtype in ("auto", "float32", "bfloat16", "float16", "int4"),
            f"bad matmul_dtype {self.matmul_dtype!r}",
        )
        check(self.max_model_len >= 2, "max_model_len must be >= 2")
        check(self.max_batched_tokens >= 1, "max_batched_tokens must be >= 1")
        check(self.threads >= 0, "threads must be >= 0")
        parse_cpus(self.cpus)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
