"""The import graph of the installed ``tokenbudget`` namespace, read from the source (AST).

The folders sit at the repository root and ``pyproject.toml``'s ``package-dir`` maps them under
``tokenbudget``, so path-based import linters cannot follow them; this reads the same map. Every
import counts, wherever it is written: module level, inside a function (a lazy import is still a
dependency, only a later one) and under ``TYPE_CHECKING``.

``LAYERS`` is the stack, bottom first (docs/DESIGN.md, "Layers"): a module may import its own
layer and the layers below it, never one above. ``tests/test_import_layers.py`` holds the tree to
it with no exceptions; ``python tests/import_graph.py`` prints the counts and the offending edges.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module belongs to the layer of its longest matching prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("types: options, outputs, errors", ("tokenbudget.api",)),
    ("kv_cache", ("tokenbudget.kv_cache",)),
    ("scheduler: request state, the step contract", ("tokenbudget.scheduler",)),
    ("spec: proposers, controller, metrics", ("tokenbudget.spec",)),
    ("kernels", ("tokenbudget.kernels",)),
    ("text: tokenizer, detokenizer", ("tokenbudget.engine.text",)),
    ("model code", ("tokenbudget.engine.model",)),
    ("loader", ("tokenbudget.engine.loader",)),
    ("structured output", ("tokenbudget.engine.structured",)),
    ("worker: runners, sampler", ("tokenbudget.engine.worker",)),
    ("drafters: model drafters, their runner and cost probe, the factory", ("tokenbudget.engine.drafters",)),
    ("core: EngineCore, outputs, wiring", ("tokenbudget.engine.core",)),
    ("front-ends: LLM, LLMEngine, AsyncLLM, serve", ("tokenbudget.engine.entrypoints", "tokenbudget.engine.serve")),
    ("training: draft heads (train-draft)", ("tokenbudget.training",)),
    ("test kit: fake model, harness, fuzzing", ("tokenbudget.testing",)),
    ("integrations: Ray Data, Ray Serve", ("tokenbudget.integrations",)),
    ("console script, namespace root", ("tokenbudget.cli", "tokenbudget.__main__", "tokenbudget")),
)


def package_dirs() -> dict[str, Path]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / folder for pkg, folder in mapping.items()}


def modules() -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` under the mapped folders."""
    out: dict[str, Path] = {}
    dirs = package_dirs()
    for pkg, folder in dirs.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([pkg, *parts])
            # a nested folder that is itself mapped elsewhere is not part of this package
            if any(other != pkg and name.startswith(other + ".") and len(other) > len(pkg) for other in dirs):
                continue
            out[name] = path
    return out


def _resolve(target: str, names: dict[str, Path]) -> str | None:
    while target and target not in names:
        target = target.rpartition(".")[0]
    return target or None


def edges(names: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line}; only modules of the namespace."""
    names = names if names is not None else modules()
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for name, path in names.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if not t.startswith("tokenbudget"):
                    continue
                hit = _resolve(t, names)
                if hit and hit != name:
                    graph[name].setdefault(hit, node.lineno)
    return graph


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def top_package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] != "__main__" else "tokenbudget"


def package_pairs(graph) -> list[tuple[str, str]]:
    deps = {(top_package(a), top_package(b)) for a, bs in graph.items() for b in bs}
    return sorted({tuple(sorted(p)) for p in deps if p[0] != p[1] and (p[1], p[0]) in deps})


def file_circles(graph) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    nodes = set(graph) | {b for bs in graph.values() for b in bs}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def back_edges(graph) -> list[tuple[str, str, int]]:
    """Imports from a module to one in a higher layer (or to a module outside every layer)."""
    out = []
    for a, bs in graph.items():
        la = layer_of(a)
        for b, line in bs.items():
            lb = layer_of(b)
            if la < 0 or lb < 0 or lb > la:
                out.append((a, b, line))
    return sorted(out)


def main() -> int:
    names = modules()
    graph = edges(names)
    pairs, circles, back = package_pairs(graph), file_circles(graph), back_edges(graph)
    lines = sum(len(p.read_text().splitlines()) for p in names.values())
    print(f"{len(names)} modules, {lines} lines, {sum(len(v) for v in graph.values())} import edges")
    print(f"package pairs importing each other: {len(pairs)}")
    for p in pairs:
        print("   ", " <-> ".join(p))
    print(f"file circles: {len(circles)}")
    for c in circles:
        print("   ", " / ".join(c))
    print(f"back-edges (a lower layer importing a higher one): {len(back)}")
    for a, b, line in back:
        print(f"    {a}:{line} -> {b}")
    return 1 if (pairs or circles or back) else 0


if __name__ == "__main__":
    sys.exit(main())
