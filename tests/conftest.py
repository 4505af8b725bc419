"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def matrix():
    from attnkit.matrix import load_matrix

    return load_matrix(ROOT / "matrix.yaml")
