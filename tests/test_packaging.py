"""The distribution installs exactly one top-level package, ``tokenbudget``.

The design's source folders stay at the repository root and ``pyproject.toml`` maps them under the
namespace; the outer ring (api, cli, testing, training, integrations) lives in ``tokenbudget/``
itself. ``pyproject.toml`` lists every package. These tests fail when a new folder is left out of the list
(it would silently be missing from an install) or when a wheel would put anything else into
site-packages (PyPI has packages named ``engine``, ``kernels``, ``scheduler``, ``spec``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tokenbudget", "engine", "scheduler", "spec", "kv_cache", "kernels")


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_every_package_folder_is_listed():
    on_disk = set()
    for top in FOLDERS:
        for d, subdirs, files in os.walk(ROOT / top):
            subdirs[:] = [s for s in subdirs if s != "__pycache__"]
            if "__init__.py" in files:
                rel = str(Path(d).relative_to(ROOT)).replace(os.sep, ".")
                on_disk.add(rel if top == "tokenbudget" else "tokenbudget." + rel)
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert listed == on_disk


def test_folders_refuse_their_bare_names():
    """``import engine`` from the repository root would load a second copy of every module."""
    for name in ("engine", "scheduler", "spec", "kv_cache"):  # kernels: see kernels/__init__.py
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and "installs as tokenbudget." in proc.stderr, name


@pytest.mark.slow
def test_wheel_holds_only_the_tokenbudget_namespace(tmp_path):
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ into the source tree
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in FOLDERS:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("tokenbudget-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"tokenbudget"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "tokenbudget/engine/entrypoints/llm.py" in names and "tokenbudget/scheduler/scheduler.py" in names
    assert "tokenbudget/integrations/ray/data.py" in names
    assert "tokenbudget/kernels/cpu/quant_gemm.c" in names  # compiled at first use: the source must ship
