"""The C kernel variants (``kernels/cpu/native.py``) as a pytest parameter (conftest's ``variant``): every variant, run
where this CPU can execute it (``scalar`` everywhere), skipped naming the missing instructions
where it cannot. A variant the CPU can execute that fails to build fails the test under CI
(``CI=true``): CI must build and test the kernels of the machine it runs on.
"""

from __future__ import annotations

import os

import pytest

from tokenbudget.kernels.cpu import native

VARIANTS = [v.name for v in native.VARIANTS]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def use_variant(name: str, monkeypatch):
    """Select ``name`` for the test (``TOKENBUDGET_NATIVE``) and return its loaded library."""
    lacks = native.missing(name)
    if lacks:
        pytest.skip(f"CPU lacks {', '.join(lacks)} (C kernel variant {name})")
    lib = native.load(name)
    if lib is None:
        why = f"C kernel variant {name} failed to build: {native.build_error(name)}"
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)
    monkeypatch.setenv(native.ENV, name)
    return lib
