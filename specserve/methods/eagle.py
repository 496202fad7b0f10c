"""EAGLE heads: one decoder layer beside a target that guesses its next hidden state from
its last one and the token after it (Li et al., 2024, "EAGLE"; the target frozen).

Entry t reads fc([f_t, e(x_{t+1})]): the target's normed last hidden state at position t
(the LM head's input, as Medusa heads read it: specserve/methods/medusa.py) and the
target's embedding of the token after it. One Llama decoder layer over the entries so far
and a norm give g_t, the head's guess of f_{t+1}; the LM head's rows over g_t guess token
t + 2. A draft chain feeds each guess back as the next entry's feature, with the token it
drafted. The head attends over a session's generated text only, from the prompt's last
position on: the verifier keeps the hidden states of the tokens it verifies, and the
prompt's context was measured to add nothing (docs/benchmarks.md, "EAGLE heads on
SmolLM2").

The head drafts among `vocabulary`, the target's commonest tokens in the text it was trained
on, through its own copy of those rows of the target's LM head (`lm_rows`): a 49,152-token
LM head would cost a drafting step as much as the layer many times over.

A head's directory holds `config.json` (EagleConfig, with the fingerprint of the target it
was made for, as Medusa heads') and `model.safetensors`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from specserve.methods.medusa import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsMismatch,
    check_made_for,
    read_checkpoint,
    target_fingerprint,
)
from specserve.model.llama import mlp, rms_norm, rope_tables, rotate

FORMAT = "specserve-eagle-head"
ROPE_TABLE_MIN = 1024  # positions in the smallest RoPE table a head keeps


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab: int  # the rows of the LM head it drafts among
    target_fingerprint: str
    target_name: str = ""
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise HeadsMismatch(f"not an EAGLE head config (format {self.format!r}, expected {FORMAT!r})")

    @classmethod
    def for_target(cls, target_dir: str | Path, draft_vocab: int) -> EagleConfig:
        config = json.loads((Path(target_dir) / CONFIG_NAME).read_text())
        heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        return cls(
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            vocab_size=config["vocab_size"],
            draft_vocab=min(draft_vocab, config["vocab_size"]),
            target_fingerprint=target_fingerprint(target_dir),
            target_name=Path(target_dir).resolve().name,
        )

    def check_target(self, target_dir: str | Path) -> None:
        """Raises HeadsMismatch, naming the difference, unless this head fits the target."""
        check_made_for(self.target_fingerprint, self.target_name, target_dir, "the EAGLE head was")


class EagleHead(nn.Module):
    """fc([feature, embedding]) -> one Llama decoder layer -> a norm: the next feature; its
    draft tokens through lm_rows, among vocabulary."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.intermediate_size
        heads, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.fc = nn.Linear(2 * hidden, hidden)
        self.qkv = nn.Linear(hidden, heads + 2 * kv, bias=False)
        self.o = nn.Linear(heads, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.norms = nn.Parameter(torch.ones(3, hidden))  # the layer's input and post-attention, the output's
        self.register_buffer("vocabulary", torch.arange(config.draft_vocab))
        self.register_buffer("lm_rows", torch.zeros(config.draft_vocab, hidden))
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0.. (angles)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., head_dim] of positions [...] (default RoPE at the config's theta),
        read from a table of every position up to a power of two past the largest asked."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < needed or self._rope[0].device != positions.device:
            c = self.config
            rope = SimpleNamespace(
                rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                head_dim=c.head_dim,
                hidden_size=c.hidden_size,
                num_attention_heads=c.num_heads,
            )
            size = max(ROPE_TABLE_MIN, 1 << (needed - 1).bit_length())
            self._rope = rope_tables(rope, size, positions.device, torch.float)
        return self._rope[0][positions], self._rope[1][positions]

    def entries(self, feature: torch.Tensor, embedding: torch.Tensor, positions: torch.Tensor):
        """x [..., T, hidden] and q, k, v [..., T, heads, d] of entries (feature, embedding)."""
        c = self.config
        x = self.fc(torch.cat([feature, embedding], -1))
        qkv = self.qkv(rms_norm(x, self.norms[0].to(x.dtype), c.rms_norm_eps))
        q, k, v = qkv.split([c.num_heads * c.head_dim, *[c.num_kv_heads * c.head_dim] * 2], -1)
        shape = (*x.shape[:-1], -1, c.head_dim)
        cos, sin = self.angles(positions)
        q, k = rotate(q.reshape(shape), cos, sin).to(x.dtype), rotate(k.reshape(shape), cos, sin).to(x.dtype)
        return x, q, k, v.reshape(shape)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The guessed features [..., T, hidden] of entries x, given their attention [..., T, heads, d]."""
        eps = self.config.rms_norm_eps
        x = x + self.o(attended.flatten(-2))
        x = x + mlp(self, rms_norm(x, self.norms[1].to(x.dtype), eps))
        return rms_norm(x, self.norms[2].to(x.dtype), eps)

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor):
        """Teacher-forced, causal: entries [B, T, hidden] -> (guessed features, (keys, values))."""
        x, q, k, v = self.entries(feature, embedding, torch.arange(feature.shape[-2]))
        attended = attend(q, k, v, causal=True)
        return self.finish(x, attended), (k, v)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """Attention of q [B, T, heads, d] over k, v [B, S, kv_heads, d]: where mask [T, S] says
    (True: may attend), causally where T = S and causal says, else over every key. (torch's
    is_causal aligns its mask to the first key: one query would see the first key only.)"""
    assert not causal or q.shape[1] == k.shape[1], "a causal attention's queries are its keys"
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2)


def save_head(head: EagleHead, out_dir: str | Path) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().contiguous() if name == "vocabulary" else tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in head.state_dict().items()
    }
    save_file(state, str(out / WEIGHTS_NAME))
    (out / CONFIG_NAME).write_text(json.dumps(asdict(head.config), indent=2) + "\n")


def load_head(head_dir: str | Path, target_dir: str | Path) -> EagleHead:
    """The head in head_dir, checked against the target in target_dir (HeadsMismatch if it
    was made for another; FileNotFoundError if the directory lacks a file), in float32."""
    config, state = read_checkpoint(head_dir, target_dir, EagleConfig, "an EAGLE head's", "specserve train-eagle")
    head = EagleHead(config)
    if set(state) != set(head.state_dict()):
        raise HeadsMismatch(f"{head_dir} does not hold an EAGLE head: {sorted(state)[:4]}")
    try:
        head.load_state_dict({name: t if name == "vocabulary" else t.float() for name, t in state.items()})
    except RuntimeError as error:  # shapes that are not its config's
        raise HeadsMismatch(f"{head_dir} does not hold the head its config.json describes: {error}") from None
    return head.eval()
