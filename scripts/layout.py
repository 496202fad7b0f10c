"""The source's shape, measured: module and function lengths, import cycles between the
project's modules (imports under `if TYPE_CHECKING:` count: a cycle hidden there is still
two modules that cannot be read apart), `# fmt: skip` in runtime code, lists of method names
outside the methods' registry, and whether any tool sits in the runtime packages.
Prints a report; exits 1 where a limit is passed
(tests/test_layout.py runs it).

    python scripts/layout.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specserve", "gateway", "draft_service", "verify_service", "kernels")
TOOLS = ROOT / "specserve" / "tools"  # bench, load, fuzz, training, ...: not runtime code
GENERATED = ROOT / "specserve" / "v1"
# Commands that measure, train or test the service rather than serve.
TOOL_MODULES = {"bench", "demo_eval", "fuzz", "load", "protogen", "testing", "trace_report", "train_demo", "workloads"}
MAX_MODULE_LINES = 500  # runtime modules: split by responsibility, well before this
MAX_FUNCTION_LINES = 60  # every function outside kernels/


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if GENERATED not in p.parents)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "kernels":
        parts = ("specserve_kernels", *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.name, length))
    return found


def method_lists(tree: ast.AST) -> list[int]:
    """Lines of tuples, lists, sets and Literal[...] that name two methods (draft_model and
    ngram): the method names are written once, in specserve/methods/registry.py, and read
    from it everywhere else."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if {"draft_model", "ngram"} <= values:
                found.append(node.lineno)
    return found


def module_imports(tree: ast.AST, name: str, known: set[str]) -> set[str]:
    """The project's modules this one imports, anywhere in it: a lazy import inside a
    function, or one under `if TYPE_CHECKING:`, still ties the two together."""
    package = name.rsplit(".", 1)[0] if "." in name else name
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def main() -> int:
    paths = sources()
    trees = {p: ast.parse(p.read_text(), str(p)) for p in paths}
    names = {p: module_name(p) for p in paths}
    known = set(names.values())
    problems = []
    for path, tree in trees.items():
        relative = path.relative_to(ROOT)
        lines = len(path.read_text().splitlines())
        runtime = TOOLS not in path.parents
        if runtime and lines > MAX_MODULE_LINES:
            problems.append(f"{relative}: {lines} lines (runtime modules: at most {MAX_MODULE_LINES})")
        if runtime and "# fmt: skip" in path.read_text():
            problems.append(f"{relative}: `# fmt: skip` in runtime code (lay it out so the formatter agrees)")
        if runtime:
            for line in method_lists(tree):
                problems.append(
                    f"{relative}:{line}: method names listed (read them from specserve/methods/registry.py)"
                )
        if relative.parts[0] != "kernels":
            for function, length in long_functions(tree):
                problems.append(f"{relative}: {function}() is {length} lines (at most {MAX_FUNCTION_LINES})")
    graph = {names[p]: module_imports(t, names[p], known) for p, t in trees.items()}
    for cycle in cycles(graph):
        problems.append("import cycle: " + " -> ".join(cycle))
    for path in paths:
        if path.parent == ROOT / "specserve" and path.stem in TOOL_MODULES:
            problems.append(
                f"{path.relative_to(ROOT)}: a tool in the runtime package (its place: {TOOLS.relative_to(ROOT)})"
            )
    print(f"{len(paths)} modules, {sum(len(p.read_text().splitlines()) for p in paths)} lines")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
