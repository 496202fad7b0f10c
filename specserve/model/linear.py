"""A weight matrix's product, as fast as the device allows and, for a verifier, the same for
a row whatever the rows beside it; and the choice of the matrices' dtype.

Greedy speculative output is target-only output only where a token's logits do not depend
on how many rows its forward multiplies: a verify of K + 1 tokens must round each row as a
decode of one would. Every matrix a verifier multiplies is probed for that once it is built
(row_independent)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class Linear:
    """x @ weight.T (+ bias) in the weight's dtype, returned in x's dtype.

    On a CPU, F.linear hands a 16-bit weight to oneDNN, which reorders the whole matrix into
    its blocked layout on every call: for one row that reorder is most of the cost, so the
    matrix is reordered once here (docs/benchmarks.md, "Matrix dtypes on a CPU"). The
    prepacked product is the same oneDNN kernel, bitwise equal to F.linear's and
    row-independent. A float32 matrix is prepacked where products must not depend on the row
    count (a verifier's): F.linear's float32 kernels (MKL) round differently for 1, 2-3 and 4
    or more rows, oneDNN's the same for every count of two or more."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        row_invariant: bool = True,
        int8: bool = False,
        int4: bool = False,
    ):
        """int8: keep the matrix as int8 rows with a bfloat16 scale each (a draft's, where the CPU
        multiplies bfloat16 natively; see Weights.draft_int8). int4: as 4-bit groups of
        INT4_GROUP inputs, each with a bfloat16 scale and zero (see quantize_groups)."""
        self.out_features, self.in_features = weight.shape
        self.device = weight.device
        self.quantized = quantize_rows(weight) if int8 else None  # rows are multiplied in bfloat16
        self.int4 = quantize_groups(weight) if int4 else None
        self.dtype = torch.bfloat16 if int8 or int4 else weight.dtype
        weight = None if int8 or int4 else weight
        self.bias = bias
        self.packed = prepack(weight, row_invariant) if weight is not None else None
        self.weight = weight if self.packed is None else None
        # oneDNN's float32 product of one row takes another kernel than that of two or more
        # (which agree bitwise whatever the count): a lone row goes in twice.
        self.pad_single = self.packed is not None and self.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x if x.dtype == self.dtype else x.to(self.dtype)
        if self.quantized is not None:
            y = torch._weight_int8pack_mm(h, *self.quantized)
            y = y if self.bias is None else y + self.bias
        elif self.int4 is not None:
            y = torch._weight_int4pack_mm_for_cpu(h, self.int4[0], INT4_GROUP, self.int4[1])
            y = y if self.bias is None else y + self.bias
        elif self.packed is not None:
            if self.pad_single and h.shape[0] == 1:
                y = torch.ops.mkldnn._linear_pointwise(h.expand(2, -1), self.packed, self.bias, "none", [], "")[:1]
            else:
                y = torch.ops.mkldnn._linear_pointwise(h, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(h, self.weight, self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def int8_products_work() -> bool:
    """Whether this torch multiplies bfloat16 rows by int8 ones (torch._weight_int8pack_mm)."""
    try:
        rows, scales = quantize_rows(torch.ones(8, 64))
        return bool(torch._weight_int8pack_mm(torch.ones(1, 64, dtype=torch.bfloat16), rows, scales).eq(64).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (int8 [out, in], bfloat16 scales [out]), for
    torch._weight_int8pack_mm."""
    weight = weight.float()
    scales = (weight.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    rows = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return rows.contiguous(), scales.to(torch.bfloat16).contiguous()


# Inputs per 4-bit group, each with its own scale and zero: a GGUF Q4_0 or Q4_1 file's block
# size, so a matrix read from one is split where the file split it.
INT4_GROUP = 32
INT4 = "int4"  # the matmul_dtype that asks for them


def int4_products_work(in_features: int, device: torch.device) -> str | None:
    """Why 4-bit products cannot serve here (None where they can): PyTorch's CPU kernel
    multiplies bfloat16 rows by 4-bit groups (torch._weight_int4pack_mm_for_cpu)."""
    if device.type != "cpu":
        return "4-bit matrices are served on a CPU only"
    if in_features % INT4_GROUP:
        return f"a matrix's inputs ({in_features}) are not a multiple of {INT4_GROUP}"
    try:
        packed, scales_and_zeros = quantize_groups(torch.ones(16, 64))
        y = torch._weight_int4pack_mm_for_cpu(
            torch.ones(1, 64, dtype=torch.bfloat16), packed, INT4_GROUP, scales_and_zeros
        )
        return None if bool(y.eq(64).all()) else "torch's 4-bit product gave a wrong result on this CPU"
    except (AttributeError, RuntimeError, NotImplementedError) as error:
        return f"this torch has no CPU 4-bit product ({str(error).splitlines()[0] if str(error) else error})"


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of INT4_GROUP inputs (min to max in 16 steps, llama.cpp's Q4_1
    rule): (packed weight, bfloat16 [in / INT4_GROUP, out, 2] scales and zeros), for
    torch._weight_int4pack_mm_for_cpu. Each row's product is its own, whatever the rows beside
    it (row_independent probes it), and the kernel reads a matrix once for a few rows: a
    verify of K + 1 rows costs less than K + 1 steps."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)  # [out, groups]
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    levels = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.reshape(out_features, in_features).contiguous(), 1)
    zero = low + 8 * scale  # the kernel computes (level - 8) * scale + zero
    scales_and_zeros = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def prepack(weight: torch.Tensor, row_invariant: bool = True) -> torch.Tensor | None:
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


def auto_matmul_dtype(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The matrices' dtype when none is asked for. Verifying K + 1 tokens at about the price of
    one step is what makes speculation pay, and the verifier's products must not depend on the
    row count (greedy output stays target-only's), so the choice is the fastest kernel that is
    row-independent and cheap for many rows: bfloat16, prepacked (see Linear), where the CPU
    multiplies it natively (AVX512-BF16 or AMX), float32 elsewhere, where float16 kernels work
    row by row and bfloat16 is converted in software, both rounding differently with the
    number of rows (docs/benchmarks.md, "Matrix dtypes on a CPU"). Activations, norms and the
    KV cache stay in dtype; on CUDA dtype is already 16-bit. A draft takes the same choice,
    though its results need not be row-independent: in a running stack, where the verifier's
    forwards evict its matrices from the caches between rounds, 16-bit ones are read faster."""
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


PROBE_ROWS = (2, 3, 4, 5, 8, 16, 17, 33, 80, 144)  # up to 16 rows x K + 1 = 9


def row_independent(linear: Linear) -> bool:
    """Whether linear's product of each row is bitwise the same alone and in batches of
    PROBE_ROWS rows, at any offset."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS) + 1, linear.in_features, generator=generator).to(linear.device)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    return all(torch.equal(linear(x[o : o + n]), alone[o : o + n]) for n in PROBE_ROWS for o in (0, 1))
