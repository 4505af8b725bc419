"""matrix.yaml's torch facts against PyTorch's published release compatibility table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TABLE = Path(__file__).parent / "data" / "pytorch_release_matrix.md"


def published() -> dict[str, dict[str, object]]:
    rows: dict[str, dict[str, object]] = {}
    for line in TABLE.read_text().splitlines():
        m = re.match(r"^\| (\d+\.\d+) \| (.*?) \| C\+\+\d+ \| (.*?) \| (.*?) \|", line)
        if not m:
            continue
        minor, py, stable, exp = m.groups()
        lo = re.search(r">=(\d+\.\d+)", py).group(1)  # type: ignore[union-attr]
        hi = re.search(r"<=\(?(\d+\.\d+)", py).group(1)  # type: ignore[union-attr]
        rows[minor] = {"python": (lo, hi), "stable": re.findall(r"CUDA (\d+\.\d+)", stable),
                       "experimental": re.findall(r"CUDA (\d+\.\d+)", exp)}
    return rows


def test_table_parses_all_releases():
    assert set(published()) >= {"2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14"}


@pytest.mark.parametrize("minor", ["2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14"])
def test_torch_release_matches_published_table(matrix, minor: str) -> None:
    row = published()[minor]
    rel = matrix.torch[minor]
    assert (rel.python.min, rel.python.max) == row["python"]
    assert rel.cuda.stable == row["stable"]
    assert rel.cuda.experimental == row["experimental"]


def test_every_built_cell_is_allowed_by_the_table(matrix) -> None:
    from attnkit.matrix.expand import all_cells
    from attnkit.matrix.schema import vkey

    rows = published()
    for c in all_cells(matrix):
        row = rows[c.torch]
        lo, hi = row["python"]  # type: ignore[misc]
        assert vkey(lo) <= vkey(c.python) <= vkey(hi), c.id
        if c.cuda is not None:
            assert c.cuda in [*row["stable"], *row["experimental"]], c.id  # type: ignore[misc]
            assert c.cuda_experimental == (c.cuda in row["experimental"]), c.id  # type: ignore[operator]


def test_reference_cell_is_the_h200_machine(matrix) -> None:
    from attnkit.matrix.expand import find_cell

    c = find_cell(matrix, "torch2.11-cu130-py312")
    assert c.torch_version == "2.11.0" and c.cxx11_abi
    assert {p.name for p in c.packages} == {"flash-attn", "xformers"}
    assert "90" in c.package("flash-attn").archs  # type: ignore[union-attr]


def test_flash_attn_archs_follow_nvcc_limits(matrix) -> None:
    from attnkit.matrix.expand import all_cells
    from attnkit.matrix.schema import vkey

    cells = {c.id: c for c in all_cells(matrix)}
    for c in cells.values():
        fa = c.package("flash-attn")
        if c.cuda is None:
            continue
        assert fa is not None
        builder = cells[fa.built_in]
        # a shared cu12/cu13 wheel is built by the newest toolkit of its torch x CUDA-major x Python
        assert builder.torch == c.torch and builder.python == c.python
        assert builder.cuda.split(".")[0] == c.cuda.split(".")[0] and vkey(builder.cuda) >= vkey(c.cuda)
        same = [x for x in cells.values() if x.torch == c.torch and x.python == c.python and x.cuda
                and x.cuda.split(".")[0] == c.cuda.split(".")[0]]
        assert builder.cuda == max((x.cuda for x in same), key=vkey)
        expected = ("80", "90") if builder.cuda == "12.6" else ("80", "90", "100", "120")  # sm100+ need 12.8
        assert fa.archs == expected, (c.id, fa.archs)


def test_every_wheel_has_exactly_one_builder(matrix) -> None:
    from attnkit.matrix.expand import all_cells

    owners: dict[str, set[str]] = {}
    for c in all_cells(matrix):
        for p in c.packages:
            owners.setdefault(p.wheel, set()).add(p.built_in)
    assert all(len(v) == 1 for v in owners.values())
    assert owners["flash_attn-2.8.3.post2+cu12torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"] == {
        "torch2.11-cu128-py312"}


def test_package_limits_respected(matrix) -> None:
    from attnkit.matrix.expand import all_cells
    from attnkit.matrix.schema import vkey

    for c in all_cells(matrix):
        names = {p.name for p in c.packages}
        if c.cuda is None:
            assert names == set()
        else:
            assert ("xformers" in names) == (vkey(c.torch) >= vkey("2.10")), c.id
            assert "flash-attn" in names
