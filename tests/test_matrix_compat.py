"""matrix.yaml's torch facts against PyTorch's published release compatibility table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TABLE = Path(__file__).parent / "data" / "pytorch_release_matrix.md"
# torch 2.15's row, assembled from PyPI and PyTorch's announced plan (RELEASE.md's row could not be read; see the file)
TABLE_215 = Path(__file__).parent / "data" / "pytorch_2.15_row.md"
PYPI = Path(__file__).parent / "data" / "pypi"
MINORS = ["2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15"]


def published() -> dict[str, dict[str, object]]:
    rows: dict[str, dict[str, object]] = {}
    for line in [*TABLE.read_text().splitlines(), *TABLE_215.read_text().splitlines()]:
        m = re.match(r"^\| (\d+\.\d+) \| (.*?) \| C\+\+\d+ \| (.*?) \| (.*?) \|", line)
        if not m:
            continue
        minor, py, stable, exp = m.groups()
        lo = re.search(r">=(\d+\.\d+)", py).group(1)  # type: ignore[union-attr]
        hi = re.search(r"<=\(?(\d+\.\d+)", py).group(1)  # type: ignore[union-attr]
        rows[minor] = {"python": (lo, hi), "stable": re.findall(r"CUDA (\d+\.\d+)", stable),
                       "experimental": re.findall(r"CUDA (\d+\.\d+)", exp)}
    return rows


def test_table_parses_all_releases(matrix):
    assert set(published()) >= set(MINORS) == set(matrix.torch)


@pytest.mark.parametrize("minor", MINORS)
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


def test_torch_2_15_matches_its_pypi_release(matrix) -> None:
    """torch 2.15's row against PyPI's record of it (tests/data/pypi/torch.json, trimmed from pypi.org/pypi/torch/json
    on 2026-12-01): its newest 2.15.x, Requires-Python's lower bound, the newest CPython it has a wheel for, and the
    CUDA its PyPI wheels are built with (the cuda-toolkit pin) among the stable CUDAs."""
    import json

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from attnkit.matrix.schema import vkey

    doc = json.loads((PYPI / "torch.json").read_text())
    rel = matrix.torch["2.15"]
    versions = [v for v in doc["releases"] if Version(v).release[:2] == (2, 15) and not Version(v).is_prerelease]
    assert rel.version == max(versions, key=Version) == "2.15.0"
    files = doc["releases"][rel.version]
    assert {f["requires_python"] for f in files} == {">=3.11"}
    spec = SpecifierSet(files[0]["requires_python"])
    assert f"{rel.python.min}.0" in spec and "3.10.0" not in spec
    tags = {m.group(1) for f in files if (m := re.search(r"-cp3(\d+)-cp3\d+-", f["filename"]))}
    assert rel.python.max == f"3.{max(map(int, tags))}" and rel.python.min == f"3.{min(map(int, tags))}"
    toolkit = next(r for r in doc["info"]["requires_dist"] if r.startswith("cuda-toolkit["))
    pypi_cuda = re.search(r"==(\d+\.\d+)\.", toolkit).group(1)  # type: ignore[union-attr]
    assert pypi_cuda == "13.2" and pypi_cuda in rel.cuda.stable
    assert "12.6" not in rel.all_cuda() and vkey(rel.python.min) > vkey(matrix.torch["2.14"].python.min)


def test_reference_cell_is_the_h200_machine(matrix) -> None:
    from attnkit.matrix.expand import find_cell

    c = find_cell(matrix, "torch2.11-cu130-py312")
    assert c.torch_version == "2.11.0" and c.cxx11_abi
    assert {p.name for p in c.packages} == {"flash-attn", "xformers", "flash-attn-3"}
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


def test_every_python_the_table_ships_is_built(matrix) -> None:
    """Each torch's stable CUDAs are built for every Python of its published range from 3.10 on: 3.14 from
    torch 2.9, 3.15 from 2.13 (the table's "<=(3.15, 3.15t experimental)"); the free-threaded builds are not."""
    from attnkit.matrix.expand import all_cells
    from attnkit.matrix.schema import vkey

    built = {(c.torch, c.cuda, c.python) for c in all_cells(matrix)}
    excluded = {(s.torch, s.python) for s in matrix.build.exclude}
    for minor, row in published().items():
        lo, hi = row["python"]  # type: ignore[misc]
        pythons = [f"3.{n}" for n in range(10, 16) if vkey(lo) <= vkey(f"3.{n}") <= vkey(hi)]
        for cuda in row["stable"]:  # type: ignore[attr-defined]
            for py in pythons:
                if (minor, py) not in excluded:
                    assert (minor, cuda, py) in built, (minor, cuda, py)
    assert ("2.9", "12.8", "3.14") in built and ("2.13", "13.0", "3.15") in built
    assert not any(p == "3.15" and vkey(t) < vkey("2.13") for t, _, p in built)
    flash = [c for c in all_cells(matrix) if c.python == "3.14" and c.package("flash-attn")]
    assert flash and all(c.package("flash-attn").wheel.endswith("-cp314-cp314-linux_x86_64.whl")  # type: ignore[union-attr]
                         for c in flash)


def test_names_are_formed_in_the_naming_module_only() -> None:
    """'cu130', 'cp312' and the like: formed by matrix/naming.py alone (one place per fact)."""
    src = Path(__file__).resolve().parents[1] / "src" / "attnkit"
    pattern = re.compile(r"""f["']c[up]\{|["']c[up]["']\s*\+""")
    offenders = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py") if p.name != "naming.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_no_source_points_outside_the_repository() -> None:
    """Docstrings and comments cite evidence inside the repository (docs/results, tests/data), never the
    workplace's shared notes, which a user's checkout does not have."""
    root = Path(__file__).resolve().parents[1]
    files = [*(root / "src").rglob("*.py"), *(root / "tests").rglob("*.py"), root / "noxfile.py",
             *(root / ".github").rglob("*.yml"), root / "docker" / "Dockerfile", root / "matrix.yaml"]
    hits = [f"{p.relative_to(root)}" for p in files if re.search(r"shared/FACTS|shared/DESIGN|\.\./shared", p.read_text())
            and p.name != "test_matrix_compat.py"]
    assert hits == []


def test_flash_attn_4_is_a_pypi_package_of_the_cuda_cells(matrix) -> None:
    """FlashAttention-4: no build, pinned per CUDA major, in every CUDA cell of torch >= 2.11, none before."""
    from attnkit.matrix.expand import all_cells
    from attnkit.matrix.schema import vkey

    for c in all_cells(matrix):
        fa4 = c.pypi_package("flash-attn-4")
        if c.cuda is None or vkey(c.torch) < vkey("2.11") or c.python == "3.15":  # no cp315 CuTe DSL libs
            assert fa4 is None, c.id
            continue
        assert fa4 is not None and fa4.version == "4.0.0b36", c.id
        major = c.cuda.split(".")[0]
        assert fa4.requirements[0] == ("flash-attn-4[cu13]==4.0.0b36" if major == "13" else "flash-attn-4==4.0.0b36")
        assert ("nvidia-cutlass-dsl[cu13]==4.8.1" in fa4.requirements) == (major == "13"), c.id
        assert c.package("flash-attn-4") is None  # never in the build jobs
    assert "flash-attn-4" not in {p for c in all_cells(matrix) for p in (x.name for x in c.packages)}


def test_pyproject_fa4_extras_pin_what_the_matrix_pins(matrix) -> None:
    """`pip install attnkit[fa4]` and the images install the same FlashAttention-4 set."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    fa4 = matrix.pypi_packages["flash-attn-4"].requires
    for extra, label in (("fa4", "cu13"), ("fa4-cu12", "cu12")):
        assert set(extras[extra]) <= set(fa4[label]), (extra, extras[extra], fa4[label])


def test_pypi_package_pins_are_checked_at_load(tmp_path) -> None:
    from attnkit.errors import AttnkitError
    from attnkit.matrix.load import parse_matrix

    text = (Path(__file__).resolve().parents[1] / "matrix.yaml").read_text()
    bad = text.replace('"quack-kernels==0.6.5",\n             "apache', '"quack-kernels>=0.6",\n             "apache', 1)
    assert bad != text
    with pytest.raises(AttnkitError, match=r"m.yaml:\d+: pypi_packages.flash-attn-4.requires.cu13: 'quack-kernels>=0.6' "
                                           r"is not pinned with =="):
        parse_matrix(bad, "m.yaml")
    bad = text.replace('cu12: ["flash-attn-4==4.0.0b36", ', 'cu12: ["flash-attn-4==4.0.0b35", ', 1)
    with pytest.raises(AttnkitError, match=r"requires\.cu12: must start with flash-attn-4==4\.0\.0b36"):
        parse_matrix(bad, "m.yaml")
