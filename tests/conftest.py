"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def matrix():
    from attnkit.matrix import load_matrix

    return load_matrix(ROOT / "matrix.yaml")


@pytest.fixture(scope="session")
def py() -> str:
    """The e2e venv's interpreter (a CUDA build of the cell's torch): `nox -s e2e` sets ATTNKIT_E2E_PYTHON."""
    import os

    p = os.environ.get("ATTNKIT_E2E_PYTHON")
    if not p:
        pytest.fail("ATTNKIT_E2E_PYTHON is not set: run `nox -s e2e` (it provides a CUDA torch environment)")
    return p


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """One empty ATTNKIT_CACHE_DIR for the e2e session: the PyPI toolkit is provisioned into it once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tinyext_built(py, cache, tmp_path_factory) -> tuple[Path, dict]:
    """The tinyext fixture built once, unsharded, through the whole pipeline: the wheel pipeline's tests check it
    and the sharded build is compared with it (a build costs over a minute on 2 cores)."""
    import json

    from test_wheel_pipeline import attnkit, build_args

    base = tmp_path_factory.mktemp("built")
    r = attnkit(py, cache, *build_args(base / "house", base / "build", py), "--report", str(base / "report.json"))
    return base / "house", json.loads(r.stdout)
