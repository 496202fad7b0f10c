from __future__ import annotations

from dataclasses import dataclass

from specserve.config import check, field
from specserve.paths import DEMO_DRAFT
from specserve.serving.options import ServiceOptions


@dataclass(frozen=True)
class DraftConfig(ServiceOptions):
    model: str = field(str(DEMO_DRAFT), "directory of the draft model (Hugging Face format)")
    port: int = field(50051, "gRPC port")
    early_exit_model: str = field("", "target model directory whose first layers serve method early_exit (empty: none)")
    early_exit_layers: int = field(2, "layers of the target the early_exit drafter runs")
    max_speculative_tokens: int = field(16, "largest K accepted per request")
    max_sessions: int = field(256, "most concurrent sessions (streams); beyond it RESOURCE_EXHAUSTED")
    max_batch: int = field(64, "most draft requests processed in one batch")
    max_wait_ms: float = field(0.0, "how long a lone request waits for others to share its batch")
    matmul_dtype: str = field(
        "auto",
        "dtype of the runner's weight matrices: auto (on a CPU: int8 where it has bfloat16, else float32 for small "
        "matrices and the checkpoint's 16-bit dtype or float32 for the rest), or a dtype",
    )
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
    grace_s: float = field(10.0, "on SIGTERM, how long in-flight streams may take to finish")

    def __post_init__(self) -> None:
        self.check_service()
        check(self.early_exit_layers >= 1, "early_exit_layers must be >= 1")
        check(self.max_workers > self.max_sessions, "max_workers must exceed max_sessions: each stream holds a thread")
