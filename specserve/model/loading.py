"""Loading Hugging Face causal LMs from local directories into a backend: our runner for
the Llama family, transformers for the rest."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import resolve_dtype
from specserve.model.backends import Backend, RunnerBackend, TransformersBackend
from specserve.model.linear import INT4
from specserve.paths import missing_tokenizer

log = logging.getLogger(__name__)

BACKENDS = ("auto", "runner", "transformers")


@dataclass(frozen=True)
class LoadedModel:
    backend: Backend
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
    """The tokenizer of a model directory; a ValueError in one line where it has none (not
    transformers' guess at a missing package)."""
    from transformers import AutoTokenizer

    directory = check_model_dir(path)
    missing = missing_tokenizer(directory)
    if missing:
        raise ValueError(f"{directory} has {missing}")
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """Digest of the token -> id mapping: a draft and a target must share it exactly."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def load_for_service(
    config,
    model: str | None = None,
    num_layers: int | None = None,
    row_invariant: bool = True,
    compile_steps: bool = False,
) -> LoadedModel:
    """Loads config.model (or model) as a service config asks (device, dtype, threads,
    backend, slots); num_layers keeps the first layers only (early exit); row_invariant=False
    for a draft (see auto_matmul_dtype); compile_steps builds compiled steps (see LlamaRunner)."""
    from specserve.config import parse_cpus, resolve_device

    device = resolve_device(config.device)
    threads = config.threads or len(parse_cpus(config.cpus))
    if threads:
        torch.set_num_threads(threads)
    return load_model(
        model or config.model,
        device,
        resolve_dtype(config.dtype, device),
        name=getattr(config, "served_model_name", ""),
        backend=config.backend,
        num_slots=config.max_sessions,
        max_model_len=config.max_model_len,
        matmul_dtype=config.matmul_dtype,
        num_layers=num_layers,
        row_invariant=row_invariant,
        compile_steps=compile_steps,
        precise_scoring=row_invariant and getattr(config, "precise_prompt_logprobs", False),  # a target's
    )


def load_model(
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    name: str = "",
    backend: str = "auto",
    num_slots: int = 16,
    max_model_len: int = 4096,
    matmul_dtype: str = "auto",
    num_layers: int | None = None,
    row_invariant: bool = True,
    compile_steps: bool = False,
    precise_scoring: bool = False,
) -> LoadedModel:
    """precise_scoring: a runner keeps float32 matrices for prompts' logprobs where its own
    are 16-bit on a CPU (LlamaRunner)."""
    from transformers import AutoConfig

    directory = check_model_dir(path)
    started = time.perf_counter()
    tokenizer = load_tokenizer(path)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    matmul = None if matmul_dtype == "auto" else INT4 if matmul_dtype == INT4 else resolve_dtype(matmul_dtype, device)
    if num_layers is not None and backend == "transformers":
        raise ValueError("early exit (num_layers) needs the runner backend")
    loaded_backend = _load_backend(
        directory,
        config,
        device=device,
        dtype=dtype,
        backend=backend,
        num_slots=num_slots,
        max_model_len=max_model_len,
        matmul_dtype=matmul,
        num_layers=num_layers,
        row_invariant=row_invariant,
        compile_steps=compile_steps,
        precise_scoring=precise_scoring,
    )
    log.info(
        "loaded %s with the %s backend (%s, %s%s) in %.1f s",
        directory,
        loaded_backend.name,
        device,
        dtype,
        _matmul_note(loaded_backend, dtype),
        time.perf_counter() - started,
    )
    return LoadedModel(
        backend=loaded_backend,
        tokenizer=tokenizer,
        name=name or directory.resolve().name,
        vocab_size=loaded_backend.vocab_size,
        max_context_length=loaded_backend.max_context_length,
        eos_token_ids=_eos_token_ids(directory, config, tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        device=device,
    )


def _matmul_note(backend: Backend, dtype: torch.dtype) -> str:
    runner = getattr(backend, "runner", None)
    if runner is None or runner.matmul_dtype == dtype:
        return ""
    return f", matrices in {'4-bit groups' if runner.int4 else runner.matmul_dtype}"


def _load_backend(
    directory: Path,
    config,
    device,
    dtype,
    backend: str,
    num_slots: int,
    max_model_len: int,
    matmul_dtype,
    num_layers=None,
    row_invariant=True,
    compile_steps=False,
    precise_scoring=False,
) -> Backend:
    from specserve.model.runner import LlamaRunner, UnsupportedModel

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend in ("auto", "runner"):
        try:
            runner = LlamaRunner(
                str(directory),
                device,
                dtype,
                num_slots,
                max_model_len,
                matmul_dtype,
                num_layers,
                row_invariant=row_invariant,
                compile_steps=compile_steps,
                precise_scoring=precise_scoring,
            )
            return RunnerBackend(runner)
        except UnsupportedModel as error:
            if backend == "runner" or num_layers is not None:
                raise
            log.warning("the runner cannot serve %s (%s); falling back to transformers", directory, error)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True).to(device).eval()
    text_config = config.get_text_config()
    max_len = min(int(getattr(text_config, "max_position_embeddings", max_model_len)), max_model_len)
    return TransformersBackend(model, device, max_len, num_slots)


def _eos_token_ids(directory: Path, config, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [config, tokenizer]
    if (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        sources.insert(0, GenerationConfig.from_pretrained(str(directory)))
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))
