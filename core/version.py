"""batchd's version, as installed (``pyproject.toml``'s ``version``), written once."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("batchd")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
