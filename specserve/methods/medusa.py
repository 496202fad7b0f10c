"""Medusa heads: small blocks on a target's last hidden state that guess the tokens after
its next one, all at once (Cai et al., 2024, "Medusa-1": the target frozen).

Head i (0-based) reads the target's final hidden state h_t (after its last norm, the input
of its LM head) at position t and guesses the token at t + i + 2: the target's own LM head
guesses t + 1. Each head is one residual SiLU block, h + SiLU(W h + b), feeding the target's
LM head, which the heads share and do not store (the demo target's would be 6 MB a head).

A heads directory holds `config.json` (MedusaConfig: the number of heads and their shape,
and which target they were made for) and `model.safetensors` (`heads.{i}.weight`,
`heads.{i}.bias`). Heads made for another target are refused at loading: the target's hidden
size and vocabulary must match, and so must the fingerprint of its config.json.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
FORMAT = "specserve-medusa-heads"
# config.json fields that describe how a checkpoint was saved, not the model: two saves of
# one target differ in them and must share heads.
_NOT_THE_MODEL = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures", "use_cache")


class HeadsMismatch(ValueError):
    """Heads that were made for another target (or are not heads at all)."""


def target_fingerprint(target_dir: str | Path) -> str:
    """sha256 of the target's config.json without its saving details: the architecture,
    vocabulary and special tokens the heads were trained against."""
    config = json.loads((Path(target_dir) / CONFIG_NAME).read_text())
    kept = {key: value for key, value in config.items() if key not in _NOT_THE_MODEL}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int
    target_fingerprint: str
    target_name: str = ""  # where the heads were trained from, for people (not checked)
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise HeadsMismatch(f"not a Medusa heads config (format {self.format!r}, expected {FORMAT!r})")
        if not 1 <= self.num_heads <= 16:
            raise HeadsMismatch(f"num_heads must lie in 1..16, got {self.num_heads}")

    @classmethod
    def for_target(cls, target_dir: str | Path, num_heads: int) -> MedusaConfig:
        config = json.loads((Path(target_dir) / CONFIG_NAME).read_text())
        return cls(
            num_heads=num_heads,
            hidden_size=config["hidden_size"],
            vocab_size=config["vocab_size"],
            target_fingerprint=target_fingerprint(target_dir),
            target_name=Path(target_dir).resolve().name,
        )

    def check_target(self, target_dir: str | Path) -> None:
        """Raises HeadsMismatch, naming the difference, unless these heads fit the target."""
        target = MedusaConfig.for_target(target_dir, self.num_heads)
        for name in ("hidden_size", "vocab_size"):
            if getattr(self, name) != getattr(target, name):
                raise HeadsMismatch(
                    f"the heads were made for a target with {name} {getattr(self, name)}, "
                    f"{target_dir} has {getattr(target, name)}"
                )
        check_made_for(self.target_fingerprint, self.target_name, target_dir, "the heads were")


def check_made_for(fingerprint: str, name: str, target_dir: str | Path, what: str) -> None:
    """Raises HeadsMismatch unless fingerprint, of the target a checkpoint was made for
    (named name; what: "the heads were", say), is target_dir's."""
    actual = target_fingerprint(target_dir)
    if fingerprint != actual:
        raise HeadsMismatch(
            f"{what} made for another target ({name or 'unnamed'}, config sha256 "
            f"{fingerprint[:12]}), not {target_dir} (config sha256 {actual[:12]})"
        )


def residual_block(hidden: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    """A head's guess of a later position's hidden state: hidden + SiLU(W hidden + b), given
    the product W hidden + b."""
    return hidden + nn.functional.silu(product)


class MedusaHeads(nn.Module):
    """The heads' blocks; logits(hidden, lm_head) gives every head's guesses."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_heads))
        for head in self.heads:  # a head starts as the identity: it guesses what the LM head guesses
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden_size] (the target's normed last hidden state) -> [heads, ..., hidden_size]."""
        return torch.stack([residual_block(hidden, head(hidden)) for head in self.heads])

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[heads, ..., vocab] float32: each head's logits, through the target's LM head weight [vocab, hidden]."""
        out = self(hidden.to(lm_head.dtype))
        return (out @ lm_head.T).float()


def save_heads(heads: MedusaHeads, out_dir: str | Path) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(torch.float16).contiguous() for name, tensor in heads.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME))
    (out / CONFIG_NAME).write_text(json.dumps(asdict(heads.config), indent=2) + "\n")


def load_heads(heads_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """The heads in heads_dir, checked against the target in target_dir (HeadsMismatch if
    they were made for another; FileNotFoundError if the directory lacks a file)."""
    config, state = read_checkpoint(heads_dir, target_dir, MedusaConfig, "a Medusa heads", "specserve train-medusa")
    heads = MedusaHeads(config)
    missing = set(heads.state_dict()) ^ set(state)
    if missing:
        raise HeadsMismatch(f"{heads_dir} does not hold {config.num_heads} heads: {sorted(missing)[:4]}")
    heads.load_state_dict({name: tensor.to(torch.float32) for name, tensor in state.items()})
    return heads.to(dtype).eval()


def read_checkpoint(directory: str | Path, target_dir: str | Path, config_type, kind: str, maker: str):
    """(config, tensors) of a checkpoint beside a target (Medusa heads, an EAGLE head), its
    config of config_type checked against target_dir (HeadsMismatch; FileNotFoundError for
    a missing file, naming the command that makes one)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"{directory / name} is missing: {kind} directory has {CONFIG_NAME} and {WEIGHTS_NAME} "
                f"({maker} makes one)"
            )
    try:
        config = config_type(**json.loads((directory / CONFIG_NAME).read_text()))
    except TypeError as error:
        raise HeadsMismatch(f"{directory / CONFIG_NAME} is not {kind} config: {error}") from None
    config.check_target(target_dir)
    return config, load_file(str(directory / WEIGHTS_NAME))
