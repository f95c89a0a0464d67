"""The import graph of the installed ``tokenbudget`` namespace, read from the source (AST).

The design's source folders sit at the repository root and ``pyproject.toml``'s ``package-dir``
maps them under ``tokenbudget``, so path-based import linters cannot follow them; this reads the
same map. Every import counts, wherever it is written: module level, inside a function (a lazy
import is still a dependency, only a later one), under ``TYPE_CHECKING``, and a string that names
a module of the namespace (``importlib.import_module("tokenbudget...")``, a lazy name map).

``LAYERS`` is the stack, bottom first (docs/DESIGN.md, "Layers", whose block is checked against
it): a module may import its own layer and the layers below it, never one above. Every module
must belong to a layer: a layer names packages (a package and everything under it), except the
namespace packages ``NAMESPACES``, which stand for themselves only, so a new folder belongs to no
layer until it is listed. ``FORBIDDEN`` names pairs the order allows but the design does not (the
kernels and the model code know nothing of scheduling or speculation). Benches use the public
names of the package only (``private_imports``). ``tests/test_import_layers.py`` holds the tree to
all of it with no exceptions; ``python tests/import_graph.py`` prints the counts and the offences.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module belongs to the layer of its longest matching package (NAMESPACES: exactly).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("request table: per-request records inside the step transaction", ("tokenbudget.request_table",)),
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
    ("console script, namespace root",
     ("tokenbudget.cli", "tokenbudget.__main__", "tokenbudget", "tokenbudget.engine")),
)
NAMESPACES = frozenset({"tokenbudget", "tokenbudget.engine"})  # packages that hold layers: themselves only
FORBIDDEN: tuple[tuple[str, str], ...] = (  # importer package, imported package: never, whatever the order
    ("tokenbudget.kernels", "tokenbudget.scheduler"),
    ("tokenbudget.kernels", "tokenbudget.spec"),
    ("tokenbudget.engine.model", "tokenbudget.scheduler"),
    ("tokenbudget.engine.model", "tokenbudget.spec"),
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


def folder_of(package: str) -> str:
    """Where a package (or module) of ``LAYERS`` lives, as docs/DESIGN.md writes it: ``engine/core/``,
    ``tokenbudget/api/``, ``tokenbudget/request_table.py``."""
    dirs = package_dirs()
    mapped = max((m for m in dirs if package == m or package.startswith(m + ".")), key=len)
    path = dirs[mapped].joinpath(*package[len(mapped) + 1:].split(".")) if package != mapped else dirs[mapped]
    rel = path.relative_to(ROOT).as_posix()
    return rel + "/" if path.is_dir() else rel + ".py"


def layer_folders() -> list[str]:
    """The folders of the layers, top first (the order of docs/DESIGN.md's block): namespace
    packages and ``__main__`` left out."""
    return [folder_of(p) for _, prefixes in reversed(LAYERS) for p in prefixes
            if p not in NAMESPACES and not p.endswith("__main__")]


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
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.startswith("tokenbudget.") and node.value in names):
                targets = [node.value]  # a module named in a string: import_module, a lazy map
                # (the bare "tokenbudget" is also the logger's name: a package nobody imports by string)
            for t in targets:
                if not t.startswith("tokenbudget"):
                    continue
                hit = _resolve(t, names)
                if hit and hit != name:
                    graph[name].setdefault(hit, node.lineno)
    return graph


def _within(module: str, package: str) -> bool:
    return module == package or (package not in NAMESPACES and module.startswith(package + "."))


def layer_of(module: str) -> int:
    """The index of the module's layer in ``LAYERS``, or -1 for a module of no layer."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _within(module, p) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def unlisted(names) -> list[str]:
    """Modules of no layer (a new folder nobody placed)."""
    return sorted(m for m in names if layer_of(m) < 0)


def forbidden_edges(graph) -> list[tuple[str, str, int]]:
    """Imports the order allows and ``FORBIDDEN`` does not."""
    return sorted((a, b, line) for a, bs in graph.items() for b, line in bs.items()
                  if any(_within(a, x) and _within(b, y) for x, y in FORBIDDEN))


def private_imports(folder: Path = ROOT / "benches") -> list[str]:
    """``from tokenbudget... import _name`` (and ``module._name``) in the scripts of ``folder``:
    benches use what the package makes public, so a refactor cannot break them unseen."""
    out = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names if a.name.startswith("tokenbudget")}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokenbudget"):
                out += [f"{path.name}:{node.lineno} {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and isinstance(node.value, ast.Name) and node.value.id in modules):
                out.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return out


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
    lost, banned, private = unlisted(names), forbidden_edges(graph), private_imports()
    lines = sum(len(p.read_text().splitlines()) for p in names.values())
    print(f"{len(names)} modules, {lines} lines, {sum(len(v) for v in graph.values())} import edges")
    print(f"modules in no layer: {len(lost)}")
    for m in lost:
        print("   ", m)
    print(f"package pairs importing each other: {len(pairs)}")
    for p in pairs:
        print("   ", " <-> ".join(p))
    print(f"file circles: {len(circles)}")
    for c in circles:
        print("   ", " / ".join(c))
    print(f"back-edges (a lower layer importing a higher one): {len(back)}")
    for a, b, line in back:
        print(f"    {a}:{line} -> {b}")
    print(f"forbidden edges ({', '.join(f'{x} -> {y}' for x, y in FORBIDDEN)}): {len(banned)}")
    for a, b, line in banned:
        print(f"    {a}:{line} -> {b}")
    print(f"private names imported by benches: {len(private)}")
    for p in private:
        print("   ", p)
    return 1 if (lost or pairs or circles or back or banned or private) else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--layers"]:  # the folders of docs/DESIGN.md's layer block, top first
        print("\n".join(layer_folders()))
        sys.exit(0)
    sys.exit(main())
