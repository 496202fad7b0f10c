"""Loading Hugging Face causal LMs from local directories, and running them with a
per-session KV cache (transformers' own forward; the engine issue adds a faster runner)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    device: torch.device


def check_model_dir(path: str) -> Path:
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(f"{path!r} is not a model directory: it has no config.json")
    return directory


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_model_dir(path)), local_files_only=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """Digest of the token -> id mapping: a draft and a target must share it exactly."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def load_for_service(config) -> LoadedModel:
    """Loads config.model as a service config asks (device, dtype, threads, served name)."""
    from specserve.config import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    return load_model(
        config.model, device, resolve_dtype(config.dtype, device), getattr(config, "served_model_name", "")
    )


def load_model(path: str, device: torch.device, dtype: torch.dtype, name: str = "") -> LoadedModel:
    from transformers import AutoModelForCausalLM

    directory = check_model_dir(path)
    started = time.perf_counter()
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    config = model.config.get_text_config()
    log.info("loaded %s (%s, %s) in %.1f s", directory, device, dtype, time.perf_counter() - started)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or directory.resolve().name,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        max_context_length=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        device=device,
    )


def _eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


class CachedSequence:
    """One session's KV cache in transformers' DynamicCache; rolled back by cropping."""

    def __init__(self, loaded: LoadedModel):
        from transformers import DynamicCache

        self._loaded = loaded
        self.cache = DynamicCache()
        self.length = 0  # tokens whose keys and values are in the cache

    @torch.inference_mode()
    def extend(self, token_ids: list[int]) -> torch.Tensor:
        """Appends token_ids to the cache; returns their logits [len(token_ids), vocab] float32."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self._loaded.device)  # [1, n]
        out = self._loaded.model(input_ids=ids, cache=self.cache, use_cache=True)
        self.length += len(token_ids)
        return out.logits[0].float()

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count removes that many
            self.length = length
