"""The import contract: imports only go down the layers (``import_graph.LAYERS``, drawn in
docs/DESIGN.md, whose block is checked against it), with no exception listed anywhere.

Read from the source with the AST, so a lazy import inside a function counts as much as one at the
top of a module, and a module named in a string (``importlib.import_module``) as much as an import:
the same dependency, paid later. A new folder must be given a layer; a new import that climbs one,
or that the design forbids whatever the order (``FORBIDDEN``), fails here, in CI, before review;
so does a bench that reaches for a private name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import import_graph as ig

TESTS = Path(__file__).resolve().parent


def test_every_module_is_in_a_layer():
    assert ig.unlisted(ig.modules()) == []
    # a folder nobody placed belongs to no layer (not, silently, to the namespace root's)
    assert ig.unlisted(["tokenbudget.newfolder.thing", "tokenbudget.engine.newpart.thing"]) == [
        "tokenbudget.engine.newpart.thing", "tokenbudget.newfolder.thing"]


def test_no_forbidden_edge():
    assert ig.forbidden_edges(ig.edges()) == []
    planted = {"tokenbudget.kernels.kv_write": {"tokenbudget.scheduler.output": 1},
               "tokenbudget.engine.model.decoder": {"tokenbudget.spec.proposer": 2}}
    assert len(ig.forbidden_edges(planted)) == 2


def test_a_module_named_in_a_string_is_an_edge(tmp_path):
    names = ig.modules()
    planted = tmp_path / "planted.py"
    planted.write_text('import importlib\nimportlib.import_module("tokenbudget.engine.core.engine_core")\n')
    names["tokenbudget.kv_cache.planted"] = planted
    graph = ig.edges(names)
    assert ("tokenbudget.kv_cache.planted", "tokenbudget.engine.core.engine_core", 2) in ig.back_edges(graph)
    assert "tokenbudget.engine.entrypoints.llm" in graph["tokenbudget"]  # the package's lazy name map


def test_benches_use_public_names(tmp_path):
    assert ig.private_imports() == []
    (tmp_path / "bench.py").write_text("import tokenbudget.engine.core.wiring as w\n"
                                       "from tokenbudget.engine.core.wiring import _x, wire_engine\nw._y()\n")
    assert ig.private_imports(tmp_path) == ["bench.py:2 tokenbudget.engine.core.wiring._x", "bench.py:3 w._y"]


def test_the_design_draws_these_layers():
    """docs/DESIGN.md's layer block lists exactly the layers' folders, top first
    (``python tests/import_graph.py --layers`` prints them)."""
    text = (ig.ROOT / "docs" / "DESIGN.md").read_text()
    block = text.split("### Layers", 1)[1].split("```", 2)[1]
    drawn = [line.split()[0] for line in block.splitlines() if line[:2].strip() and not line.startswith("  ")]
    assert drawn == ig.layer_folders()


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
