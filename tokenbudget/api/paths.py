"""The one cache root: where the default model is fetched to and the C kernels are compiled to.

At the bottom of the stack because both the loader (``engine/loader/default_model.py``) and the
kernels (``kernels/cpu/native.py``) use it, and the kernels sit below the loader.
"""

from __future__ import annotations

import os

__all__ = ["cache_dir"]


def cache_dir() -> str:
    """``$TOKENBUDGET_CACHE`` or ``~/.cache/tokenbudget`` (not created here)."""
    return os.environ.get("TOKENBUDGET_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenbudget")
