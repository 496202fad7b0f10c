"""The Llama family's forward, defined once: the architecture facts (RunnerSpec), a decoder
layer's weights (Layer) and its functions. The runner's eager forward (runner.py) and its
compiled one-token steps (compiled_steps.py) are both made of these; they differ only in how
attention reads the KV cache (a ragged batch's layout, or each token's own slot), which each
passes to decoder_layer as attend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.model.linear import Linear

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


@dataclass
class Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v fused in one matmul
    o: Linear  # [hidden, heads * head_dim]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]: gate and up fused
    down: Linear  # [hidden, intermediate]


# attend(q [T, heads, d], k [T, kv_heads, d], v [T, kv_heads, d]) -> [T, heads * d]: stores
# the new keys and values in the cache and attends over what the tokens may see.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_layer(x: torch.Tensor, layer: Layer, spec: RunnerSpec, cos, sin, attend: Attend) -> torch.Tensor:
    """One decoder layer over tokens x [T, hidden]: attention, then the MLP, each added to
    its input. cos and sin [T, head_dim] are each token's RoPE."""
    q, k, v = attention_inputs(layer, rms_norm(x, layer.input_norm, spec.rms_norm_eps), spec, cos, sin)
    x = x + layer.o(attend(q, k, v))
    return x + mlp(layer, rms_norm(x, layer.post_norm, spec.rms_norm_eps))


def attention_inputs(layer: Layer, h: torch.Tensor, spec: RunnerSpec, cos, sin):
    """q [T, heads, d], k and v [T, kv_heads, d] of normed tokens h: one product for the
    three, each head's norm (Qwen3), then RoPE on q and k in one go."""
    heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv = layer.qkv(h)  # [T, (heads + 2 kv_heads) d]
    qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
    qk, v = qk.view(-1, heads + kv_heads, d), v.view(-1, kv_heads, d)
    if layer.q_norm is not None:
        q, k = qk.split([heads, kv_heads], dim=1)
        qk = torch.cat([rms_norm(q, layer.q_norm, spec.rms_norm_eps), rms_norm(k, layer.k_norm, spec.rms_norm_eps)], 1)
    q, k = rotate(qk, cos, sin).split([heads, kv_heads], dim=1)
    return q, k, v


def mlp(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU: gate and up in one product."""
    gate, up = layer.gate_up(h).chunk(2, dim=-1)
    return layer.down(F.silu(gate) * up)


def final_logits(x: torch.Tensor, norm: torch.Tensor, lm_head: Linear, eps: float) -> torch.Tensor:
    """Logits [T, vocab] float32 of the last layer's tokens x [T, hidden]."""
    return final_outputs(x, norm, lm_head, eps)[0]


def final_outputs(
    x: torch.Tensor, norm: torch.Tensor, lm_head: Linear, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """final_logits, and the tokens' hidden states after the final norm [T, hidden] (the LM
    head's input, which Medusa heads read: specserve/methods/medusa.py)."""
    normed = rms_norm(x, norm, eps)
    return lm_head(normed).float(), normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32 whatever x's dtype, as transformers' Llama does."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by per-token cos/sin [T, d] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_tables(config, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] of every position."""
    inv_freq, scaling = rope_parameters(config, device)
    freqs = torch.arange(max_len, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, head_dim]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rope_parameters(config, device: torch.device) -> tuple[torch.Tensor, float]:
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


@dataclass(frozen=True)
class BatchLayout:
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
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (token, slot, position) of
    # every place a new key is stored, where not only its own (token-tree nodes: forward_nodes)
