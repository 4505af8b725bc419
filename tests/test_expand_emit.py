"""Expansion (filters, include/exclude), naming, and the JSON / GitHub / bake / README outputs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest

from attnkit.cli import main
from attnkit.matrix import CellFilter, emit, expand, naming
from attnkit.matrix.expand import all_cells

ROOT = Path(__file__).resolve().parents[1]

# upstream flash-attn release naming (setup.py get_wheel_url)
UPSTREAM_FA = re.compile(
    r"^flash_attn-\d+\.\d+\.\d+(\.post\d+)?\+cu\d+torch\d+\.\d+cxx11abi(TRUE|FALSE)-cp(\d+)-cp\3-linux_x86_64\.whl$")

CELL_SCHEMA = {
    "type": "object",
    "required": ["id", "torch", "cuda", "python", "cuda_archs", "image_tags", "wheels"],
    "properties": {
        "id": {"type": "string", "pattern": r"^torch\d+\.\d+-(cu\d+|cpu)-py\d+$"},
        "torch": {"type": "string"},
        "cuda": {"type": ["string", "null"]},
        "python": {"type": "string"},
        "cuda_archs": {"type": "array", "items": {"type": "string"}},
        "image_tags": {"type": "object", "required": ["runtime", "devel"],
                       "additionalProperties": {"type": "array", "minItems": 1, "items": {"type": "string"}}},
        "wheels": {"type": "object", "additionalProperties": {"type": "string", "pattern": r"\.whl$"}},
    },
}
GITHUB_SCHEMA = {
    "type": "object", "required": ["include"], "additionalProperties": False,
    "properties": {"include": {"type": "array", "minItems": 1, "maxItems": 256, "items": {
        "type": "object", "required": ["cell", "torch", "cuda", "python"],
        "additionalProperties": {"type": ["string", "boolean", "integer"]}}}},
}
BAKE_SCHEMA = {
    "type": "object", "required": ["target", "group"],
    "properties": {
        "group": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["targets"], "properties": {"targets": {"type": "array"}}}},
        "target": {"type": "object",
                   "propertyNames": {"pattern": r"^[A-Za-z0-9_-]+$"},
                   "additionalProperties": {
                       "type": "object", "required": ["context", "dockerfile", "target", "args", "tags", "platforms"],
                       "properties": {"args": {"type": "object", "additionalProperties": {"type": "string"}},
                                      "tags": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                      "platforms": {"type": "array", "minItems": 1}}}},
    },
}


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main(["matrix", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_cells_validate(capsys):
    cells = run_json(capsys, "--format", "json")
    assert isinstance(cells, list) and len(cells) > 20
    for c in cells:
        jsonschema.validate(c, CELL_SCHEMA)
    ids = [c["id"] for c in cells]
    assert len(ids) == len(set(ids))
    tags = [t for c in cells for v in c["image_tags"].values() for t in v]
    assert len(tags) == len(set(tags))


def test_cpu_cell_exists_and_has_no_wheels(capsys):
    cells = run_json(capsys, "--format", "json", "--cuda", "cpu")
    assert [c["id"] for c in cells] == ["torch2.13-cpu-py311"]
    assert cells[0]["cuda"] is None and cells[0]["wheels"] == {} and cells[0]["cuda_archs"] == []


def test_filters_narrow(matrix):
    every = all_cells(matrix)
    t211 = expand(matrix, CellFilter(torch="2.11"))
    assert t211 and all(c.torch == "2.11" for c in t211)
    assert {c.cuda for c in t211} == {"12.6", "12.8", "13.0"}
    one = expand(matrix, CellFilter(torch="2.11", cuda="13.0", python="3.12"))
    assert [c.id for c in one] == ["torch2.11-cu130-py312"]
    xf = expand(matrix, CellFilter(package="xformers"))
    assert xf and all(c.package("xformers") for c in xf) and len(xf) < len(every)
    py313 = expand(matrix, CellFilter(python="3.13"))
    assert all(c.python == "3.13" for c in py313)
    assert not any(c.torch == "2.8" for c in py313)  # excluded by build.exclude


def test_include_adds_experimental_cells(matrix):
    c = expand(matrix, CellFilter(torch="2.10", cuda="13.0"))
    assert [x.id for x in c] == ["torch2.10-cu130-py312"] and c[0].cuda_experimental


def test_flash_attn_wheel_names_follow_upstream(matrix):
    for c in all_cells(matrix):
        fa = c.package("flash-attn")
        if fa:
            assert UPSTREAM_FA.match(fa.wheel), fa.wheel
            assert f"cp{c.python.replace('.', '')}" in fa.wheel
    assert naming.wheel_filename("flash-attn", "2.8.3.post2", cuda="13.0", torch="2.11", cxx11_abi=True,
                                 python="3.12", wheel_tag="cpython") == \
        "flash_attn-2.8.3.post2+cu13torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    assert naming.wheel_local_version("12.8", "2.8", False) == "cu12torch2.8cxx11abiFALSE"


def test_xformers_wheel_is_shared_across_pythons(matrix):
    names = {c.package("xformers").wheel for c in expand(matrix, CellFilter(torch="2.11", cuda="13.0",
                                                                                  package="xformers"))}
    assert names == {"xformers-0.0.35+cu13torch2.11cxx11abiTRUE-py39-none-linux_x86_64.whl"}


def test_github_matrix_validates(capsys):
    gh = run_json(capsys, "--format", "github")
    jsonschema.validate(gh, GITHUB_SCHEMA)
    assert {e["cell"] for e in gh["include"]} == {c["id"] for c in run_json(capsys, "--format", "json")}


def test_github_matrix_per_package_dedupes_wheels(capsys):
    gh = run_json(capsys, "--format", "github", "--package", "xformers")
    jsonschema.validate(gh, GITHUB_SCHEMA)
    wheels = [e["wheel"] for e in gh["include"]]
    assert len(wheels) == len(set(wheels))
    assert all(e["package"] == "xformers" for e in gh["include"])


def test_bake_definition_validates(capsys, matrix):
    bake = run_json(capsys, "--format", "bake")
    jsonschema.validate(bake, BAKE_SCHEMA)
    n = len(all_cells(matrix))
    assert len(bake["target"]) == 2 * n
    assert len(bake["group"]["default"]["targets"]) == n
    assert set(bake["group"]["all"]["targets"]) == set(bake["target"])
    t = bake["target"]["torch2_11-cu130-py312-runtime"]
    assert t["args"]["BASE_IMAGE"] == "nvidia/cuda:13.0.2-base-ubuntu24.04"
    assert t["args"]["FLASH_ATTN_VERSION"] == "2.8.3.post2" and t["target"] == "runtime"
    assert t["tags"] == ["ghcr.io/attnkit/attnkit:torch2.11-cu130-py312-runtime"]


def test_moving_tags_have_one_owner(matrix):
    owners: dict[str, str] = {}
    for c in all_cells(matrix):
        for tags in c.moving_tags.values():
            for t in tags:
                assert t not in owners, (t, owners.get(t), c.id)
                owners[t] = c.id
    assert owners["ghcr.io/attnkit/attnkit:latest"] == "torch2.11-cu130-py312"


def test_readme_table_in_sync(matrix):
    readme = (ROOT / "docs" / "matrix.md").read_text()  # the README links it: its first screen is for newcomers
    expected = emit.replace_readme_table(readme, emit.to_markdown(matrix, all_cells(matrix)))
    assert readme == expected, "docs/matrix.md's matrix table is stale: run `nox -s readme`"


def test_readme_update_is_atomic_and_checkable(tmp_path, capsys):
    r = tmp_path / "README.md"
    r.write_text(f"# x\n{emit.README_BEGIN}\nold\n{emit.README_END}\n")
    r.chmod(0o644)
    assert main(["readme", "--readme", str(r), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["readme", "--readme", str(r)]) == 0
    assert "| torch2.11-cu130-py312 |" in r.read_text()
    assert main(["readme", "--readme", str(r), "--check"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temp file left behind
    assert r.stat().st_mode & 0o777 == 0o644  # the file keeps its mode (not the temp file's 0600)
    from attnkit._io import write_atomic

    fresh = write_atomic(tmp_path / "new.json", "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask
    fresh.unlink()
    r.write_text("no markers\n")
    assert main(["readme", "--readme", str(r)]) == 1
    assert "markers" in capsys.readouterr().err


def test_github_shard_jobs_per_wheel(capsys, matrix):
    """--shards: each wheel's job becomes `shards` compile jobs, 1/N .. N/N, with the wheel's fields."""
    wheels = run_json(capsys, "--format", "github", "--package", "flash-attn")["include"]
    shards = run_json(capsys, "--format", "github", "--package", "flash-attn", "--shards")
    n = matrix.packages["flash-attn"].shards
    assert len(shards["include"]) == n * len(wheels)
    first = [e for e in shards["include"] if e["wheel"] == wheels[0]["wheel"]]
    jsonschema.validate({"include": first}, GITHUB_SCHEMA)  # wheel-sharded.yml's matrix: one wheel's shards
    assert [e["shard"] for e in first] == [f"{i}/{n}" for i in range(1, n + 1)]
    assert all({k: v for k, v in e.items() if k != "shard"} == wheels[0] for e in first)
