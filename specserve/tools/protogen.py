"""Generate the gRPC stubs from protos/ (`specserve gen-protos`), or check they are current.

The stubs are committed so that installing specserve needs no protoc; CI runs the check so
a proto edit without regenerated stubs fails. Generated modules land in `specserve/v1/`,
matching the proto package `specserve.v1`, so their own imports resolve inside our package.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_DIR = REPO_ROOT / "specserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "specserve" / "v1").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every proto into out_root; returns the generated files."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--plugin=protoc-gen-mypy_grpc={plugin}",
        f"--mypy_grpc_out=quiet:{out_root}",
        *(str(path.relative_to(PROTO_ROOT)) for path in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its messages above")
    return sorted((out_root / "specserve" / "v1").iterdir())


def stale_files() -> list[str]:
    """Names of committed stubs that differ from freshly generated ones (or are missing/extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {path.name: path for path in generate(Path(tmp))}
        committed = {path.name: path for path in GENERATED_DIR.iterdir() if path.name.endswith(GENERATED_SUFFIXES)}
        differing = [
            name
            for name in fresh
            if name not in committed or not filecmp.cmp(fresh[name], committed[name], shallow=False)
        ]
        extra = [name for name in committed if name not in fresh]
        return sorted(differing + extra)


def write_stubs() -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        for old in GENERATED_DIR.glob("*_pb2*"):
            old.unlink()
        written = []
        for path in generate(Path(tmp)):
            target = GENERATED_DIR / path.name
            shutil.copyfile(path, target)
            written.append(target)
        return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve gen-protos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether the committed stubs are current")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run `specserve gen-protos`", file=sys.stderr)
            return 1
        print("gRPC stubs are current")
        return 0
    for path in write_stubs():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
