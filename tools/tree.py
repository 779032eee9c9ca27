"""The shape of fp8train's source tree, as a newcomer meets it: files at each package's top,
import arrows and floors inside each layer, cycles, upward imports, and the functions and
files past the size the project holds itself to (docs/architecture.md, "Reading the tree").

    python tools/tree.py            # a table per layer, then anything over a limit
    python tools/tree.py --json     # the same figures as JSON

Counting rules: a "file at the top" is a ``.py`` file directly in the layer's folder,
``__init__.py`` included (its wings, the subfolders, are counted as one entry each in the
``wings`` column). An "arrow" is one module of the layer importing another module of the
same layer (module level or inside a function, relative or absolute; a package's
``__init__`` counts as a module). "Floors" is the length of the longest chain of arrows
plus one: the number of levels a reader climbs from the layer's base to its top. An upward
import is a module importing a layer above its own (tests/spec/test_torch_free.py's order).
``tests/test_tree.py`` holds the limits.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "fp8train"
LAYERS = ("spec", "quant", "nn", "diagnostics", "parallel", "optim", "integrations", "train")
"""Lowest first, as tests/spec/test_torch_free.py orders them."""
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` names ``a.b`` where that
    is a module, else ``a``)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` where c is a name
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``."""
    mods = modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def floors(edges: dict[str, set[str]], members: set[str]) -> int:
    """The longest chain of arrows among ``members``, plus one (0 if a cycle makes it unbounded)."""
    depth: dict[str, int] = {}

    def height(v: str, seen: frozenset) -> int:
        if v in seen:
            raise ValueError("cycle")
        if v not in depth:
            depth[v] = 1 + max((height(w, seen | {v}) for w in edges[v] & members), default=0)
        return depth[v]

    try:
        return max((height(v, frozenset()) for v in members), default=0)
    except ValueError:
        return 0


def layer_figures(edges: dict[str, set[str]], layer: str) -> dict:
    folder = PACKAGE / layer
    members = {m for m in edges if layer_of(m) == layer}
    return {
        "layer": layer,
        "files_at_top": len(list(folder.glob("*.py"))),
        "wings": sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()),
        "files": len(members),
        "arrows": sum(len(edges[m] & members) for m in members),
        "floors": floors(edges, members),
    }


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(edges.items()):
        own = layer_of(module)
        for target in sorted(targets):
            other = layer_of(target)
            if own and other and LAYERS.index(other) > LAYERS.index(own):
                found.append(f"{module} -> {target}")
    return found


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function or method longer than ``limit`` lines:
    its ``def`` line to its last line, its docstring not counted (prose is not code to hold
    in one's head)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                    lines -= first.end_lineno - first.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def long_files(limit: int = MAX_FILE_LINES) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE)} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > limit
    ]


def figures() -> dict:
    edges = graph()
    return {
        "layers": [layer_figures(edges, layer) for layer in LAYERS],
        "cycles": cycles(edges),
        "upward_imports": upward_imports(edges),
        "long_functions": long_functions(),
        "long_files": long_files(),
    }


def format_report(result: dict) -> str:
    lines = ["| layer | files at top | wings | modules | arrows | floors |", "|---|---:|---|---:|---:|---:|"]
    for f in result["layers"]:
        lines.append(
            f"| {f['layer']} | {f['files_at_top']} | {', '.join(f['wings']) or '-'} | {f['files']} | "
            f"{f['arrows']} | {f['floors']} |"
        )
    for key, title in (("cycles", "import cycles"), ("upward_imports", "upward imports"),
                       ("long_functions", f"functions over {MAX_FUNCTION_LINES} lines"),
                       ("long_files", f"files over {MAX_FILE_LINES} lines")):
        items = result[key]
        lines.append(f"\n{title}: {len(items)}")
        lines += [f"  {item}" for item in items]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    result = figures()
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
