"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def matrix():
    from attnkit.matrix import load_matrix

    return load_matrix(ROOT / "matrix.yaml")


@pytest.fixture(scope="module")
def py() -> str:
    """The e2e venv's interpreter (a CUDA build of the cell's torch): `nox -s e2e` sets ATTNKIT_E2E_PYTHON."""
    import os

    p = os.environ.get("ATTNKIT_E2E_PYTHON")
    if not p:
        pytest.fail("ATTNKIT_E2E_PYTHON is not set: run `nox -s e2e` (it provides a CUDA torch environment)")
    return p


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """An empty ATTNKIT_CACHE_DIR per e2e module."""
    return tmp_path_factory.mktemp("cache")
