"""A checkpoint's tensors as the forward takes them: read from safetensors, matrices built in
the dtype chosen for the device (specserve/model/linear.py), q, k and v (and gate and up)
stacked into one product each."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specserve.model.gguf import source_bits
from specserve.model.linear import (
    INT4,
    INT4_GROUP,
    SMALL_MATRIX_ENTRIES,
    Linear,
    auto_matmul_dtype,
    cpu_has_bf16,
    int4_products_work,
    int8_products_work,
    row_independent,
)
from specserve.model.llama import Layer, RunnerSpec, UnsupportedModel

log = logging.getLogger(__name__)

PRECISE_COPY_MAX_BYTES = 4 << 30  # the largest float32 copy of a target's matrices kept for scoring


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


class Weights:
    """embed, norm, lm_head and layers of a checkpoint, for a runner on device: activations
    and norms in dtype, matrices in matmul_dtype (None: auto_matmul_dtype's choice; a draft's
    may be int8, see draft_int8). row_invariant: the matrices are probed for products that do
    not depend on the row count (a verifier's, see check_row_independence)."""

    def __init__(
        self,
        directory: Path,
        spec: RunnerSpec,
        device: torch.device,
        dtype: torch.dtype,
        matmul_dtype: torch.dtype | None,
        row_invariant: bool,
    ):
        self.spec, self.device, self.dtype, self.row_invariant = spec, device, dtype, row_invariant
        weights = load_safetensors(directory)
        self.int4, self.head_bits = self._four_bit(directory, matmul_dtype)
        if self.int4:
            matmul_dtype = torch.bfloat16  # the rest: embedding rows, and matrices kept in 16 bits
        self.matmul_dtype = matmul_dtype or auto_matmul_dtype(weights, device, dtype)
        auto_int8 = not row_invariant and matmul_dtype is None and device.type == "cpu" and cpu_has_bf16()
        self.draft_matmul = "int8" if auto_int8 and int8_products_work() else ""
        if row_invariant:
            self.check_row_independence(weights, chosen=matmul_dtype is None)
        self.embed = self._embed(weights)  # rows are gathered, then cast to dtype
        self.norm = self._take(weights, "model.norm.weight")
        self.lm_head = self._lm_head(weights, self.embed)
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        if spec.qk_norm and self.layers[0].q_norm is None:
            raise UnsupportedModel("a qwen3 checkpoint without q_norm weights")

    def _four_bit(self, directory: Path, matmul_dtype) -> tuple[bool, int]:
        """(layers in 4 bits, the output head's bits): the layers' matrices kept as 4-bit groups
        (Linear's int4), multiplied by bfloat16 rows, where int4 is asked for (the head too), or
        by default where the directory was converted from a GGUF file that held them in 4 bits
        (specserve/model/gguf.py) and the CPU can multiply them; the head then as the file
        held it (4 bits, 8 bits: Linear's int8, else 16)."""
        if matmul_dtype == INT4:
            why_not = int4_products_work(self.spec.hidden_size, self.device)
            if why_not:
                raise UnsupportedModel(f"matmul_dtype int4: {why_not}")
            return True, 4
        layers, head = source_bits(directory)
        if matmul_dtype is not None or layers != 4:
            return False, 16
        why_not = int4_products_work(self.spec.hidden_size, self.device)
        if why_not:
            log.info("the GGUF file's 4-bit matrices are multiplied in 16 bits here: %s", why_not)
            return False, 16
        return True, head if head != 8 or int8_products_work() else 16

    def check_row_independence(self, weights: dict[str, torch.Tensor], chosen: bool) -> None:
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
            if all(row_independent(m) for m in probed):
                if dtype != first:
                    log.info("%s products depend on the row count on this device; matrices in %s", first, dtype)
                return
        self.matmul_dtype = first
        log.warning(
            "the runner's %s products depend on the row count on this %s: a row's logits can change with the "
            "batch it shares, and greedy speculative output may differ from target-only output in near ties",
            first,
            self.device.type,
        )

    @property
    def draft_int8(self) -> bool:
        """A draft's matrices are int8 (weight-only, a scale per row) where the CPU multiplies
        bfloat16 natively and no dtype was asked for: a draft step reads its matrices afresh
        after every verify, whose target has evicted them from the caches, and int8 rows are
        the fewest bytes; PyTorch's int8 product with bfloat16 rows is also the fastest for one
        row of a small matrix. Its proposals round differently from the checkpoint's own, which
        costs acceptance, never exactness."""
        return self.draft_matmul == "int8"

    def _take(self, weights: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in weights:
            raise UnsupportedModel(f"checkpoint lacks {name}")
        return weights[name].to(device=self.device, dtype=dtype or self.dtype)

    def _maybe(self, weights: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None = None):
        return self._take(weights, name, dtype) if name in weights else None

    def _linear(self, weights: dict[str, torch.Tensor], *names: str, head: bool = False) -> Linear:
        """The product with the named matrices stacked (q, k, v; gate, up), biases where the
        checkpoint has them, in matmul_dtype (a draft's small ones, see _draft_dtype)."""
        entries = sum(weights[n + ".weight"].numel() for n in names if n + ".weight" in weights)
        dtype = torch.float32 if self.draft_int8 else self._draft_dtype(entries)
        biases = [self._maybe(weights, n + ".bias", dtype) for n in names]
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise UnsupportedModel(f"checkpoint has only some of {', '.join(n + '.bias' for n in names)}")
        bias = None if biases[0] is None else torch.cat(biases).contiguous()
        matrices = [self._take(weights, n + ".weight", dtype) for n in names]
        weight = matrices[0] if len(names) == 1 else torch.cat(matrices).contiguous()
        if self.draft_int8 or self.int4:
            bias = None if bias is None else bias.to(torch.bfloat16)
        int4 = self._int4(weight) and (self.head_bits == 4 or not head)
        int8 = self.draft_int8 or (head and self.head_bits == 8)
        return Linear(weight, bias, self.row_invariant, int8=int8, int4=int4)

    def _int4(self, weight: torch.Tensor) -> bool:
        """Whether weight is kept in 4 bits: asked for, its inputs split into whole groups and its
        outputs into the kernel's blocks of 16 (others, a vocabulary of 259, stay 16-bit)."""
        return self.int4 and weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % 16 == 0

    def _draft_dtype(self, entries: int) -> torch.dtype:
        """A draft's matrices of at most SMALL_MATRIX_ENTRIES stay float32 on a CPU (without
        int8, see draft_int8): for one row MKL's float32 product of such a matrix is mostly
        per-call overhead, less than oneDNN's 16-bit one, and a draft's results need not be
        row-independent. Larger ones (an output layer) take matmul_dtype: half the bytes to
        stream."""
        small = not self.row_invariant and self.device.type == "cpu" and entries <= SMALL_MATRIX_ENTRIES
        return torch.float32 if small else self.matmul_dtype

    def _embed(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._take(weights, "model.embed_tokens.weight", self.matmul_dtype)

    def _lm_head(self, weights: dict[str, torch.Tensor], embed: torch.Tensor) -> Linear:
        if self.spec.tie_word_embeddings and "lm_head.weight" not in weights:
            tied = self._take(weights, "model.embed_tokens.weight", torch.float32) if self.draft_int8 else embed
            int4 = self.head_bits == 4 and self._int4(tied)
            return Linear(tied, None, self.row_invariant, int8=self.draft_int8 or self.head_bits == 8, int4=int4)
        return self._linear(weights, "lm_head", head=True)

    def _layer(self, weights: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return Layer(
            input_norm=self._take(weights, p + "input_layernorm.weight"),
            qkv=self._linear(weights, attn + "q_proj", attn + "k_proj", attn + "v_proj"),
            o=self._linear(weights, attn + "o_proj"),
            q_norm=self._maybe(weights, attn + "q_norm.weight"),
            k_norm=self._maybe(weights, attn + "k_norm.weight"),
            post_norm=self._take(weights, p + "post_attention_layernorm.weight"),
            gate_up=self._linear(weights, mlp + "gate_proj", mlp + "up_proj"),
            down=self._linear(weights, mlp + "down_proj"),
        )


def precise_copy(
    directory: Path, spec: RunnerSpec, device: torch.device, dtype: torch.dtype, matmul_dtype: torch.dtype, wanted: bool
) -> Weights | None:
    """A float32 copy of a runner's matrices for prompts' logprobs, where they are 16-bit on a
    CPU (activations float32) and the copy takes at most PRECISE_COPY_MAX_BYTES."""
    if not (wanted and device.type == "cpu" and dtype == torch.float32 != matmul_dtype):
        return None
    stored = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    if stored * 2 > PRECISE_COPY_MAX_BYTES:  # a 16-bit checkpoint's float32 copy: twice its bytes
        log.info(
            "prompts' logprobs from %s products: a float32 copy would take %.1f GB", matmul_dtype, stored * 2 / 1e9
        )
        return None
    return Weights(directory, spec, device, dtype, dtype, False)
