"""The import contract: imports only go down the layers (``import_graph.LAYERS``, drawn in
docs/DESIGN.md), with no exception listed anywhere.

Read from the source with the AST, so a lazy import inside a function counts as much as one at the
top of a module: it is the same dependency, paid later. A new file must belong to a layer; a new
import that climbs one fails here, in CI, before review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import import_graph as ig

TESTS = Path(__file__).resolve().parent


def test_every_module_is_in_a_layer():
    assert [m for m in ig.modules() if ig.layer_of(m) < 0] == []


def test_no_import_climbs_a_layer():
    assert [f"{a}:{line} -> {b}" for a, b, line in ig.back_edges(ig.edges())] == []


def test_no_two_packages_import_each_other():
    assert ig.package_pairs(ig.edges()) == []


def test_no_file_circle():
    assert ig.file_circles(ig.edges()) == []


def test_the_checks_see_what_they_forbid():
    """Each check reports a planted violation (so the three tests above cannot pass vacuously)."""
    graph = {a: dict(bs) for a, bs in ig.edges().items()}
    graph.setdefault("tokenbudget.kv_cache.block_pool", {})["tokenbudget.engine.core.engine_core"] = 1
    assert ("tokenbudget.kv_cache.block_pool", "tokenbudget.engine.core.engine_core", 1) in ig.back_edges(graph)
    graph.setdefault("tokenbudget.engine.core.engine_core", {})["tokenbudget.kv_cache.block_pool"] = 1
    assert ("tokenbudget.engine", "tokenbudget.kv_cache") in ig.package_pairs(graph)
    assert any("tokenbudget.kv_cache.block_pool" in c for c in ig.file_circles(graph))


def test_a_lazy_import_is_an_edge():
    lazy = [(a, b) for a, bs in ig.edges().items() for b in bs
            if a == "tokenbudget.cli.fuzz" and b.startswith("tokenbudget.testing")]
    assert lazy, "tokenbudget/cli/fuzz.py imports the test kit inside its function"


def test_no_test_module_imports_another():
    """Shared test code lives in helper modules (``model_helpers``, ``batch_schedules``, ...):
    importing a test module runs its module-level setup and collects its tests twice."""
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert bad == []
