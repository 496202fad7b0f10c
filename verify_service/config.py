from __future__ import annotations

from dataclasses import dataclass

from specserve.config import check, field
from specserve.errors import InvalidArgument
from specserve.methods.lookahead import DEFAULT_GUESSES, DEFAULT_NGRAM, DEFAULT_WINDOW, LookaheadShape
from specserve.paths import DEMO_TARGET
from specserve.serving.options import ServiceOptions


@dataclass(frozen=True)
class VerifyConfig(ServiceOptions):
    model: str = field(str(DEMO_TARGET), "directory of the target model (Hugging Face format)")
    served_model_name: str = field("", "name clients use for the model; default: the directory's name")
    port: int = field(50052, "gRPC port")
    max_sessions: int = field(256, "most sessions (target KV caches) held at once; beyond it RESOURCE_EXHAUSTED")
    max_speculative_tokens: int = field(16, "largest K accepted per Verify call")
    session_ttl_s: float = field(600.0, "sessions idle this long are released (their gateway may be gone)")
    max_support: int = field(1024, "largest sparse draft-distribution support accepted per position")
    max_batch: int = field(64, "most calls verified in one batch")
    max_wait_ms: float = field(
        0.0,
        "how long a lone call waits for others to share its batch (calls that arrive during a batch join the "
        "next one anyway)",
    )
    matmul_dtype: str = field(
        "auto",
        "dtype of the runner's weight matrices: auto (a 16-bit checkpoint on CPU: bfloat16 where the CPU has it, "
        "else float32; a colocated draft's: int8 where the CPU has bfloat16), a dtype for both, or int4 (4-bit "
        "groups of 32 weights, a scale and zero each, multiplied in bfloat16; CPU only)",
    )
    precise_prompt_logprobs: bool = field(
        True,
        "prompts' logprobs (echo, prompt_logprobs: scoring) from a float32 copy of the target's matrices where "
        "they are 16-bit on a CPU (the cache is then written again as a plain prefill writes it); more memory",
    )
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
        0,
        "serve method early_exit here from the target's own first layers (0: not served here; -1: as many as "
        "measured agreement with the target predicts pay best, chosen at start)",
    )
    medusa: str = field(
        "",
        "directory of Medusa heads made for this target (specserve train-medusa): requests with method medusa "
        "then draft from the target's own hidden state, no draft model (empty: not served)",
    )
    eagle: str = field(
        "",
        "directory of an EAGLE head made for this target (specserve train-eagle): requests with method eagle "
        "then draft from the target's hidden states, no draft model (empty: not served)",
    )
    lookahead_window: int = field(
        DEFAULT_WINDOW, "method lookahead: W, guesses per level of the Jacobi window (a request may set its own)"
    )
    lookahead_ngram: int = field(
        DEFAULT_NGRAM, "method lookahead: N, the size of its n-grams; a round verifies candidates of N - 1 tokens"
    )
    lookahead_guesses: int = field(DEFAULT_GUESSES, "method lookahead: G, candidates verified per round")
    lookahead_window_rounds: str = field(
        "auto",
        "method lookahead: the rounds that feed the Jacobi window: all (the paper's), uncopied (only those with no "
        "copy of the context to verify: on a CPU every token fed costs), or auto (all on a GPU, uncopied on a CPU)",
    )
    max_workers: int = field(
        300, "gRPC worker threads (concurrent calls in flight; each Decode stream holds one while it lasts)"
    )
    metrics_port: int = field(9102, "port of the Prometheus /metrics endpoint (0: none)")
    grace_s: float = field(10.0, "on SIGTERM, how long in-flight calls may take to finish")

    def __post_init__(self) -> None:
        self.check_service()
        check(self.session_ttl_s > 0, "session_ttl_s must be > 0")
        check(self.max_support >= 1, "max_support must be >= 1")
        check(self.early_exit_layers >= -1, "early_exit_layers must be >= 0, or -1 (chosen at start)")
        check(self.max_workers >= 4, "max_workers must be >= 4")
        check(
            self.lookahead_window_rounds in ("auto", "all", "uncopied"),
            "lookahead_window_rounds must be auto, all or uncopied",
        )
        try:
            _ = self.lookahead  # its checks
        except InvalidArgument as error:
            check(False, str(error))
        check(
            self.max_workers > self.max_sessions,
            "max_workers must exceed max_sessions: a Decode stream holds a thread, and other calls need some",
        )

    @property
    def lookahead(self) -> LookaheadShape:
        """Method lookahead's shape where a request sets none."""
        return LookaheadShape(self.lookahead_window, self.lookahead_ngram, self.lookahead_guesses)
