"""Our own runner for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, the demo pair),
loading Hugging Face config.json + safetensors directly.

One forward serves a ragged batch: each row appends its own number of tokens at its own
position in its own KV-cache slot (a prefill chunk, a verify of K + 1, a decode of 1), so
concurrent sessions share every weight read. Rolling a row back is setting its length:
what lies past it is overwritten by the next forward and masked until then.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import specserve_kernels.attention as attention_kernels
from specserve_kernels.attention_reference import exact_attention_reference

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Forwards of at most this many tokens per row (decode, verify) attend query by query, for
# results that do not depend on K or on the batch; longer ones (prefill) in one masked call.
EXACT_MAX_QUERIES = 16

# Keys read per row in a compiled step are rounded up to a multiple of this: never one key
# (a size torch would compile another graph for, while serving).
KEY_BLOCK = 64


class UnsupportedModel(Exception):
    """The checkpoint is not one the runner knows; the transformers backend serves it."""


@dataclass(frozen=True)
class RunnerSpec:
    """The architecture facts the forward needs, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3 normalises each head's q and k before RoPE
    sliding_window: int | None

    @classmethod
    def from_config(cls, config) -> RunnerSpec:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"model_type {config.model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation {config.hidden_act!r} (the runner implements SwiGLU with silu)")
        window = getattr(config, "sliding_window", None)
        if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=config.model_type == "qwen3",
            sliding_window=window,
        )


class _Linear:
    """x @ weight.T (+ bias) in the weight's dtype, returned in x's dtype.

    On a CPU, F.linear hands a 16-bit weight to oneDNN, which reorders the whole matrix into
    its blocked layout on every call: for one row that reorder is most of the cost (the demo
    target's 25 matrices: 1.9 ms a decode step, 0.9 ms reordered once here). The prepacked
    product is the same oneDNN kernel, bitwise equal to F.linear's and row-independent. A
    float32 matrix is prepacked where products must not depend on the row count (a
    verifier's): F.linear's float32 kernels (MKL) round differently for 1, 2-3 and 4 or more
    rows, oneDNN's the same for every count of two or more."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, row_invariant: bool = True, int8: bool = False
    ):
        """int8: keep the matrix as int8 rows with a bfloat16 scale each (a draft's, where the CPU
        multiplies bfloat16 natively; see LlamaRunner._draft_int8)."""
        self.out_features, self.in_features = weight.shape
        self.device = weight.device
        self.quantized = _quantize_rows(weight) if int8 else None  # rows are multiplied in bfloat16
        self.dtype = torch.bfloat16 if int8 else weight.dtype
        weight = None if int8 else weight
        self.bias = bias
        self.packed = _prepack(weight, row_invariant) if weight is not None else None
        self.weight = weight if self.packed is None else None
        # oneDNN's float32 product of one row takes another kernel than that of two or more
        # (which agree bitwise whatever the count): a lone row goes in twice.
        self.pad_single = self.packed is not None and self.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x if x.dtype == self.dtype else x.to(self.dtype)
        if self.quantized is not None:
            y = torch._weight_int8pack_mm(h, *self.quantized)
            y = y if self.bias is None else y + self.bias
        elif self.packed is not None:
            if self.pad_single and h.shape[0] == 1:
                y = torch.ops.mkldnn._linear_pointwise(h.expand(2, -1), self.packed, self.bias, "none", [], "")[:1]
            else:
                y = torch.ops.mkldnn._linear_pointwise(h, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(h, self.weight, self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def _int8_products_work() -> bool:
    """Whether this torch multiplies bfloat16 rows by int8 ones (torch._weight_int8pack_mm)."""
    try:
        rows, scales = _quantize_rows(torch.ones(8, 64))
        return bool(torch._weight_int8pack_mm(torch.ones(1, 64, dtype=torch.bfloat16), rows, scales).eq(64).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (int8 [out, in], bfloat16 scales [out]), for
    torch._weight_int8pack_mm."""
    weight = weight.float()
    scales = (weight.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    rows = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return rows.contiguous(), scales.to(torch.bfloat16).contiguous()


def _prepack(weight: torch.Tensor, row_invariant: bool = True) -> torch.Tensor | None:
    """oneDNN's blocked copy of a bfloat16 CPU matrix (or of a float32 one whose products must
    not depend on the row count), or None where F.linear is used as is."""
    packable = weight.dtype == torch.bfloat16 or (weight.dtype == torch.float32 and row_invariant)
    if weight.device.type != "cpu" or not packable or not torch.backends.mkldnn.is_available():
        return None
    try:
        rows = 1 if weight.dtype == torch.bfloat16 else PREPACK_ROWS
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)
    except (AttributeError, RuntimeError) as error:  # a torch without the op, or a CPU oneDNN cannot serve
        log.info("bfloat16 matrices not prepacked (%s); F.linear reorders them per call", error)
        return None


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: _Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v fused in one matmul
    o: _Linear  # [hidden, heads * head_dim]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: _Linear  # [2 * intermediate, hidden]: gate and up fused
    down: _Linear  # [hidden, intermediate]


@dataclass(frozen=True)
class _BatchLayout:
    """Index tensors of one ragged forward, shared by every layer. T = total new tokens."""

    slots: torch.Tensor  # [batch] cache slot of each row
    token_slots: torch.Tensor  # [T]
    token_positions: torch.Tensor  # [T]
    pad_index: torch.Tensor  # [T] index of each token in the padded [batch * n_max] layout
    n_max: int
    kv_len: int  # keys to read per row: max over rows of start + n
    mask: torch.Tensor | None  # [batch, 1, n_max, kv_len] bool, True = may attend; None = no mask needed
    single: tuple[int, int] | None  # (slot, start) when the batch is one row: views, no gathers
    exact: bool  # attention runs query by query (kernels' exact_attention)


def auto_matmul_dtype(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The matrices' dtype when none is asked for. Verifying K + 1 tokens at about the price of
    one step is what makes speculation pay, and the verifier's products must not depend on the
    row count (greedy output stays target-only's), so the choice is the fastest kernel that is
    row-independent and cheap for many rows. Measured on two-thread CPUs with the
    14M-parameter demo target's 25 matrices:
    - with AVX512-BF16: bfloat16, prepacked (see _Linear), 0.9 ms at 1 row and 1.0 at 5, the
      same for every row count; float32 5.9 ms at 1 and 9.9 at 5; float16 1.0 ms at 1 but 4.2
      at 5 (its kernels work row by row, and round differently with the number of rows);
    - without (AVX512 only): float32, prepacked, 4 ms at 2 rows, 4 at 5, 5 at 16 and 11 at 80;
      float16 2.5 ms at 1, 8 at 5, 26 at 16, 132 at 80; bfloat16 is converted in software
      and rounds differently with the number of rows.
    So a 16-bit checkpoint keeps bfloat16 matrices where the CPU multiplies it natively and
    float32 elsewhere. Activations, norms and the KV cache stay in dtype. On CUDA dtype is
    already 16-bit. A draft takes the same choice, though its results need not be
    row-independent: the 1.5M-parameter demo draft's step is faster in float32 in a loop that
    keeps its matrices in the CPU's caches (0.8 ms against 1.1), but in a running stack, where
    the verifier's forwards evict them between rounds, bfloat16 made speculative decoding at
    K = 4 1.05-1.07x faster (eager or compiled steps, two stacks side by side)."""
    checkpoint = next(iter(weights.values())).dtype
    if device.type != "cpu" or dtype != torch.float32 or checkpoint not in (torch.float16, torch.bfloat16):
        return dtype
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


PREPACK_ROWS = 16  # the row count oneDNN chooses a float32 matrix's blocked layout for
SMALL_MATRIX_ENTRIES = 1 << 20  # a draft's matrices up to this size stay float32 on a CPU


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        if not (directory / name).is_file():
            raise UnsupportedModel(f"{directory} has no {name} (the runner reads safetensors only)")
        weights.update(load_file(str(directory / name)))
    return weights


class LlamaRunner:
    def __init__(
        self,
        directory: str,
        device: torch.device,
        dtype: torch.dtype,
        num_slots: int,
        max_len: int,
        matmul_dtype: torch.dtype | None = None,
        num_layers: int | None = None,
        exact_attention: bool = True,
        row_invariant: bool = True,
        compile_steps: bool = False,
    ):
        """dtype is what activations, norms and the KV cache use; matmul_dtype is what the
        weight matrices are kept and multiplied in (None: see auto_matmul_dtype). num_layers
        keeps only the first layers (then the final norm and LM head): an early-exit model.
        row_invariant=False (a draft's) skips the check that products do not depend on the row
        count, and float32 matrices need not be prepacked for it.
        compile_steps (on a CPU) builds one-token steps (specserve/compiled_steps.py): a
        target's before the constructor returns, a draft's in the background; once ready,
        rows of up to EXACT_MAX_QUERIES tokens take them."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        self.spec = RunnerSpec.from_config(config)
        if num_layers is not None:
            self.spec = dataclasses.replace(self.spec, num_layers=min(num_layers, self.spec.num_layers))
        self.device, self.dtype = device, dtype
        self.max_len = min(max_len, self.spec.max_positions)
        inv_freq, scaling = _rope_parameters(config, device)
        freqs = torch.arange(self.max_len, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, head_dim]
        self._cos, self._sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
        weights = load_safetensors(Path(directory))
        self.matmul_dtype = matmul_dtype or auto_matmul_dtype(weights, device, dtype)
        auto_int8 = not row_invariant and matmul_dtype is None and device.type == "cpu" and cpu_has_bf16()
        self.draft_matmul = "int8" if auto_int8 and _int8_products_work() else ""
        self.exact_attention = exact_attention
        self._exact_attention = attention_kernels.exact_attention
        shapes = (self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim, self.spec.sliding_window)
        if self.device.type == "cuda" and not attention_kernels.triton_kernel_works(device, dtype, *shapes):
            log.warning("the Triton attention kernel failed its check on this GPU: decode and verify attention run "
                        "one SDPA call per token instead (slower, as exact)")  # fmt: skip
            self._exact_attention = exact_attention_reference
        self.row_invariant = row_invariant
        if row_invariant:
            self._check_row_independence(weights, chosen=matmul_dtype is None)
        self._load(weights)
        # Head-major, so that a row's keys of one head are contiguous: attention reads them
        # as they lie (a strided view made CPU attention of one query four times slower).
        # One slot more than served for the compiled steps' warm-up, never handed out; and a
        # key block more than served, never written: the keys the steps read (a multiple of
        # the block) are then never all the slot holds, a size torch would compile anew.
        extra = KEY_BLOCK if compile_steps else 0
        shape = (num_slots + compile_steps, self.spec.num_kv_heads, self.max_len + extra, self.spec.head_dim)
        # Uninitialised: a slot is zeroed when handed out (allocate), so on the CPU only the
        # slots ever used commit memory.
        self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(self.spec.num_layers)]
        self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(self.spec.num_layers)]
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._never_used = set(self._free_slots)  # their memory is uninitialised
        self.compiled_steps = self._start_compiled_steps() if compile_steps else None

    def _start_compiled_steps(self):
        from specserve.compiled_steps import CompiledSteps

        why_not = CompiledSteps.supported(self)
        if why_not is not None:
            log.info("one-token steps run eager: %s", why_not)
            return None
        steps = CompiledSteps(self, scratch_slot=self.num_slots)
        if self.row_invariant:
            # A target's logits must not change while it serves (its greedy output, alone or
            # verifying, is one sequence), so it compiles before serving and the eager forward
            # serves only where compiling fails.
            steps.compile()
        else:
            steps.start()
        return steps

    def _check_row_independence(self, weights: dict[str, torch.Tensor], chosen: bool) -> None:
        """Probes the first layer's matrices and the LM head, built in the chosen dtype: does
        each row's product stay the same whatever the number of rows? auto_matmul_dtype's
        choice rests on measurements of a few CPUs; where it fails here, float32 (and, for a
        float16 checkpoint, float16) is tried, and where nothing passes (or the dtype was
        asked for) a warning says greedy speculative output may then differ from target-only
        output in near ties."""
        first = self.matmul_dtype
        candidates = [first]
        if chosen and self.device.type == "cpu":
            checkpoint = next(iter(weights.values())).dtype
            others = (torch.float32, torch.float16) if checkpoint == torch.float16 else (torch.float32,)
            candidates += [d for d in others if d != first]
        for dtype in candidates:
            self.matmul_dtype = dtype
            layer = self._layer(weights, 0)
            probed = (layer.qkv, layer.o, layer.gate_up, layer.down, self._lm_head(weights, self._embed(weights)))
            if all(_row_independent(m) for m in probed):
                if dtype != first:
                    log.info("%s products depend on the row count on this device; matrices in %s", first, dtype)
                return
        self.matmul_dtype = first
        log.warning(
            "the runner's %s products depend on the row count on this %s: a row's logits can change with the "
            "batch it shares, and greedy speculative output may differ from target-only output in near ties",
            first, self.device.type,
        )  # fmt: skip

    def allocate(self) -> int | None:
        """A free cache slot, zeroed, or None when all are taken."""
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        # Rows of a batch read keys up to the longest row; a shorter row's unwritten positions
        # are masked, but a masked 0 weight times a NaN of uninitialised memory is still NaN.
        # A slot is zeroed the first time it is handed out; later it holds an earlier
        # session's keys and values, finite (zeroing the demo target's 20 MB slot again at
        # every request took milliseconds of each request's time to first token).
        if slot in self._never_used:
            for cache in (*self.k_cache, *self.v_cache):
                cache[slot].zero_()
            self._never_used.discard(slot)
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        self.embed = self._embed(weights)  # rows are gathered, then cast to dtype
        self.norm = self._take(weights, "model.norm.weight")
        self.lm_head = self._lm_head(weights, self.embed)
        self.layers = [self._layer(weights, i) for i in range(self.spec.num_layers)]
        if self.spec.qk_norm and self.layers[0].q_norm is None:
            raise UnsupportedModel("a qwen3 checkpoint without q_norm weights")

    def _take(self, weights: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in weights:
            raise UnsupportedModel(f"checkpoint lacks {name}")
        return weights[name].to(device=self.device, dtype=dtype or self.dtype)

    def _maybe(self, weights: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None = None):
        return self._take(weights, name, dtype) if name in weights else None

    def _linear(self, weights: dict[str, torch.Tensor], *names: str) -> _Linear:
        """The product with the named matrices stacked (q, k, v; gate, up), biases where the
        checkpoint has them, in matmul_dtype (a draft's small ones, see _draft_dtype)."""
        entries = sum(weights[n + ".weight"].numel() for n in names if n + ".weight" in weights)
        dtype = torch.float32 if self._draft_int8 else self._draft_dtype(entries)
        biases = [self._maybe(weights, n + ".bias", dtype) for n in names]
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise UnsupportedModel(f"checkpoint has only some of {', '.join(n + '.bias' for n in names)}")
        bias = None if biases[0] is None else torch.cat(biases).contiguous()
        matrices = [self._take(weights, n + ".weight", dtype) for n in names]
        weight = matrices[0] if len(names) == 1 else torch.cat(matrices).contiguous()
        if self._draft_int8:
            bias = None if bias is None else bias.to(torch.bfloat16)
        return _Linear(weight, bias, self.row_invariant, int8=self._draft_int8)

    @property
    def _draft_int8(self) -> bool:
        """A draft's matrices are int8 (weight-only, a scale per row) where the CPU multiplies
        bfloat16 natively and no dtype was asked for: a draft step reads its matrices afresh
        after every verify, whose target has evicted them from the caches, and int8 rows are
        the fewest bytes; PyTorch's int8 product with bfloat16 rows is also the fastest for one
        row of a small matrix. Its proposals round differently from the checkpoint's own, which
        costs acceptance, never exactness."""
        return self.draft_matmul == "int8"

    def _draft_dtype(self, entries: int) -> torch.dtype:
        """A draft's matrices of at most SMALL_MATRIX_ENTRIES stay float32 on a CPU (without
        int8, see _draft_int8): for one row MKL's float32 product of such a matrix takes a few
        microseconds, oneDNN's 16-bit one about four times as long, all of it per-call
        overhead, and a draft's results need not be row-independent. Larger ones (an output
        layer) take matmul_dtype: half the bytes to stream."""
        small = not self.row_invariant and self.device.type == "cpu" and entries <= SMALL_MATRIX_ENTRIES
        return torch.float32 if small else self.matmul_dtype

    def _embed(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._take(weights, "model.embed_tokens.weight", self.matmul_dtype)

    def _lm_head(self, weights: dict[str, torch.Tensor], embed: torch.Tensor) -> _Linear:
        if self.spec.tie_word_embeddings and "lm_head.weight" not in weights:
            tied = self._take(weights, "model.embed_tokens.weight", torch.float32) if self._draft_int8 else embed
            return _Linear(tied, None, self.row_invariant, int8=self._draft_int8)
        return self._linear(weights, "lm_head")

    def _layer(self, weights: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return _Layer(
            input_norm=self._take(weights, p + "input_layernorm.weight"),
            qkv=self._linear(weights, attn + "q_proj", attn + "k_proj", attn + "v_proj"),
            o=self._linear(weights, attn + "o_proj"),
            q_norm=self._maybe(weights, attn + "q_norm.weight"),
            k_norm=self._maybe(weights, attn + "k_norm.weight"),
            post_norm=self._take(weights, p + "post_attention_layernorm.weight"),
            gate_up=self._linear(weights, mlp + "gate_proj", mlp + "up_proj"),
            down=self._linear(weights, mlp + "down_proj"),
        )

    def forward(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> list[torch.Tensor]:
        """Row b appends tokens[b] to slot slots[b] at positions starts[b]..; returns per row the
        logits of its last num_logits[b] tokens: [num_logits[b], vocab] float32."""
        return self.forward_with_argmax(slots, starts, tokens, num_logits)[0]

    def forward_with_argmax(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> tuple[list[torch.Tensor], list[list[int] | None]]:
        """forward(), and per row the argmax of each of its logits where the compiled steps
        made it with them (None where the row ran eager): a greedy decision then needs no
        reduction over the vocabulary of its own."""
        counts = [len(t) for t in tokens]
        assert all(n > 0 for n in counts), "every row appends at least one token"
        assert all(s + n <= self.max_len for s, n in zip(starts, counts)), "a row runs past its cache slot"
        steps = self.compiled_steps
        if steps is not None and steps.ready:
            return self._forward_as_token_rows(slots, starts, tokens, num_logits)
        return self.forward_eager(slots, starts, tokens, num_logits), [None] * len(tokens)

    @torch.inference_mode()
    def forward_last(
        self, slots: list[int], starts: list[int], tokens: list[list[int]]
    ) -> tuple[torch.Tensor, list[int]]:
        """forward() for the last token of each row only, with its argmax: ([batch, vocab]
        float32 logits, [batch] argmax), what a draft's next token needs. Through the compiled
        steps, the argmax comes out of the step itself."""
        assert all(s + len(t) <= self.max_len for s, t in zip(starts, tokens)), "a row runs past its cache slot"
        steps = self.compiled_steps
        if steps is None or not steps.ready or any(len(t) > EXACT_MAX_QUERIES for t in tokens):
            logits = torch.cat(self.forward(slots, starts, tokens, [1] * len(tokens)))
            return logits, logits.argmax(-1).tolist()
        token_slots = [slot for slot, row in zip(slots, tokens) for _ in row]
        positions = [start + i for start, row in zip(starts, tokens) for i in range(len(row))]
        logits, argmax = steps.step_with_argmax(token_slots, positions, [t for row in tokens for t in row])
        if len(token_slots) == len(tokens):  # one token per row: the usual draft step
            return logits, argmax.tolist()
        last = torch.tensor(list(itertools.accumulate(len(row) for row in tokens))) - 1
        return logits[last], argmax[last].tolist()

    @torch.inference_mode()
    def _forward_as_token_rows(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> tuple[list[torch.Tensor], list[list[int] | None]]:
        """forward() with compiled steps: every token of the rows of at most
        EXACT_MAX_QUERIES tokens (decodes, verifies, a draft's steps and catch-ups, short
        prompts) is a row of one compiled step, in which each token attends to its own slot's
        keys up to its own position, so a target's results do not depend on K or on the
        batch; longer rows (prefills) run eager."""
        out: list[torch.Tensor] = [None] * len(tokens)  # type: ignore[list-item]
        best: list[list[int] | None] = [None] * len(tokens)
        short = [b for b, t in enumerate(tokens) if len(t) <= EXACT_MAX_QUERIES]
        long = [b for b, t in enumerate(tokens) if len(t) > EXACT_MAX_QUERIES]
        if long:
            pick = lambda values: [values[b] for b in long]  # noqa: E731
            for b, logits in zip(long, self.forward_eager(pick(slots), pick(starts), pick(tokens), pick(num_logits))):
                out[b] = logits
        if short:
            token_slots = [slots[b] for b in short for _ in tokens[b]]
            positions = [starts[b] + i for b in short for i in range(len(tokens[b]))]
            logits, argmax = self.compiled_steps.step_with_argmax(token_slots, positions,
                                                                  [t for b in short for t in tokens[b]])  # fmt: skip
            argmax, end = argmax.tolist(), 0
            for b in short:
                end += len(tokens[b])
                out[b], best[b] = logits[end - num_logits[b] : end], argmax[end - num_logits[b] : end]
        return out, best

    @torch.inference_mode()
    def forward_eager(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> list[torch.Tensor]:
        """forward() op by op."""
        counts = [len(t) for t in tokens]
        layout = self._layout(slots, starts, counts)
        ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=self.device)  # [T]
        x = self.embed[ids].to(self.dtype)  # [T, hidden]
        cos, sin = self._rope(layout)  # [T, head_dim]
        for index, layer in enumerate(self.layers):
            x = x + self._attention(
                index, layer, _rms_norm(x, layer.input_norm, self.spec.rms_norm_eps), cos, sin, layout
            )
            x = x + self._mlp(layer, _rms_norm(x, layer.post_norm, self.spec.rms_norm_eps))
        if len(counts) == 1:
            selected = x[-num_logits[0] :]
        else:
            ends = torch.tensor(counts, device=self.device).cumsum(0)
            picked = torch.cat([torch.arange(int(e) - k, int(e), device=self.device) for e, k in zip(ends, num_logits)])
            selected = x[picked]
        hidden = _rms_norm(selected, self.norm, self.spec.rms_norm_eps)  # [sum(num_logits), hidden]
        logits = self.lm_head(hidden).float()  # [sum(num_logits), vocab]
        return list(logits.split(num_logits))

    def _layout(self, slots: list[int], starts: list[int], counts: list[int]) -> _BatchLayout:
        # Index lists are built in Python: a forward's few hundred ints cost less that way
        # than the dozen small tensor ops that would make them.
        device = self.device
        batch, n_max = len(counts), max(counts)
        kv_len = max(s + n for s, n in zip(starts, counts))
        rows = [b for b, n in enumerate(counts) for _ in range(n)]  # [T]
        local = [i for n in counts for i in range(n)]
        positions = [starts[b] + i for b, i in zip(rows, local)]
        exact = self.exact_attention and n_max <= EXACT_MAX_QUERIES
        mask = None
        if not exact and (n_max > 1 or batch > 1 or self.spec.sliding_window is not None):
            # A lone row of one token attends to every cached key, which SDPA does unmasked.
            starts_t, counts_t = torch.tensor(starts, device=device), torch.tensor(counts, device=device)
            query_pos = starts_t[:, None] + torch.arange(n_max, device=device)[None, :]  # [batch, n_max]
            key_pos = torch.arange(kv_len, device=device)
            allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # causal, offset per row
            if self.spec.sliding_window is not None:
                allowed &= key_pos[None, None, :] > query_pos[:, :, None] - self.spec.sliding_window
            padding = torch.arange(n_max, device=device)[None, :] >= counts_t[:, None]  # [batch, n_max]
            allowed[padding] = key_pos == 0  # padded queries attend somewhere (their output is dropped)
            mask = allowed[:, None]  # [batch, 1, n_max, kv_len]
        return _BatchLayout(
            slots=torch.tensor(slots, device=device),
            token_slots=torch.tensor([slots[b] for b in rows], device=device),
            token_positions=torch.tensor(positions, device=device),
            pad_index=torch.tensor([b * n_max + i for b, i in zip(rows, local)], device=device),
            n_max=n_max,
            kv_len=kv_len,
            mask=mask,
            single=(slots[0], starts[0]) if batch == 1 else None,
            exact=exact,
        )

    def _rope(self, layout: _BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of each token's position, from the table made at load."""
        if layout.single is not None:
            start = layout.single[1]
            end = start + layout.token_positions.shape[0]
            return self._cos[start:end], self._sin[start:end]  # views
        return self._cos[layout.token_positions], self._sin[layout.token_positions]

    def _attention(self, index: int, layer: _Layer, h: torch.Tensor, cos, sin, layout: _BatchLayout) -> torch.Tensor:
        spec = self.spec
        heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = layer.qkv(h)  # [T, (heads + 2 kv_heads) d]
        qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        qk, v = qk.view(-1, heads + kv_heads, d), v.view(-1, kv_heads, d)
        if layer.q_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            qk = torch.cat(
                [_rms_norm(q, layer.q_norm, spec.rms_norm_eps), _rms_norm(k, layer.k_norm, spec.rms_norm_eps)], 1
            )
        q, k = _apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)  # q and k rotated in one go
        k_cache, v_cache = self.k_cache[index], self.v_cache[index]  # [slots, kv_heads, max_len, d]
        if layout.single is not None:
            slot, start = layout.single
            k_cache[slot, :, start : start + k.shape[0]] = k.transpose(0, 1)  # writes the new keys
            v_cache[slot, :, start : start + k.shape[0]] = v.transpose(0, 1)
        else:
            k_cache[layout.token_slots, :, layout.token_positions] = k  # writes the new keys: [T, kv_heads, d]
            v_cache[layout.token_slots, :, layout.token_positions] = v
        if layout.exact:
            slots, positions = layout.token_slots, layout.token_positions
            scale = 1 / math.sqrt(d)
            out = self._exact_attention(
                q, k_cache, v_cache, slots, positions, spec.sliding_window, scale, layout.kv_len
            )  # [T, heads, d]
            return layer.o(out.reshape(-1, heads * d))
        return layer.o(self._attention_masked(q, k_cache, v_cache, layout))

    def _attention_masked(self, q: torch.Tensor, k_cache, v_cache, layout: _BatchLayout) -> torch.Tensor:
        """All queries of the batch in one masked call over the rows' padded keys."""
        heads, d = q.shape[1], q.shape[2]
        if layout.single is not None:
            slot, _ = layout.single
            keys = k_cache[slot, None, :, : layout.kv_len]  # [1, kv_heads, kv_len, d], a view
            values = v_cache[slot, None, :, : layout.kv_len]
            queries = q[None].transpose(1, 2)  # [1, heads, n, d]
        else:
            batch = layout.slots.shape[0]
            keys = k_cache[layout.slots, :, : layout.kv_len]  # [batch, kv_heads, kv_len, d]
            values = v_cache[layout.slots, :, : layout.kv_len]
            padded = q.new_zeros(batch * layout.n_max, heads, d)
            padded[layout.pad_index] = q
            queries = padded.view(batch, layout.n_max, heads, d).transpose(1, 2)  # [batch, heads, n_max, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=layout.mask, scale=1 / math.sqrt(d), enable_gqa=heads != keys.shape[1]
        )  # [batch, heads, n_max, d]
        out = out.transpose(1, 2).reshape(-1, heads * d)  # [batch * n_max, heads d]
        return out if layout.single is not None else out[layout.pad_index]  # [T, heads d]

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)


PROBE_ROWS = (2, 3, 4, 5, 8, 16, 17, 33, 80, 144)  # up to 16 rows x K + 1 = 9


def _row_independent(linear: _Linear) -> bool:
    """Whether linear's product of each row is bitwise the same alone and in batches of
    PROBE_ROWS rows, at any offset."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS) + 1, linear.in_features, generator=generator).to(linear.device)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    return all(torch.equal(linear(x[o : o + n]), alone[o : o + n]) for n in PROBE_ROWS for o in (0, 1))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32 whatever x's dtype, as transformers' Llama does."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by per-token cos/sin [T, d] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rope_parameters(config, device: torch.device) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] and the cos/sin scale, computed by transformers' own RoPE
    initialisers so every rope_type it knows (llama3, linear, yarn, ...) is exact."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        base = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.to(device), 1.0
    if rope_type == "dynamic":
        raise UnsupportedModel("dynamic RoPE scaling changes with sequence length; served by transformers")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq.to(device=device, dtype=torch.float), float(scaling)
