"""The installed package's version: ``tokenbudget --version`` and the server's ``GET /version``."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The version pip installed (pyproject's ``version``); ``0+unknown`` for a source tree that
    was never installed."""
    try:
        return importlib.metadata.version("tokenbudget")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
