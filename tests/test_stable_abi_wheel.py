"""End to end, with real compilation: a stable-ABI extension (tests/fixtures/stableext: one .cu file on
torch::stable::Tensor and STABLE_TORCH_LIBRARY, TORCH_TARGET_VERSION 2.13, py_limited_api cp39) goes through the
pipeline as ONE abi3 wheel: nvcc from PyPI against torch 2.14.1 (CUDA 13.0), verified (abi3 tag, no torch C++
symbols, imports under torch 2.14 and 2.13), indexed under every key it serves, installed with pip and uv into
venvs of two torch minors (2.13.0 CPU, 2.14.1 CUDA) where its op runs on CPU, and refused below its floor.

Run by `nox -s e2e` (ATTNKIT_E2E_PYTHON: the venv with torch 2.14.1 and uv).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_wheel_pipeline import attnkit, fresh_venv, one_line_error
from wheelkit import fake_torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests" / "fixtures" / "stableext" / "recipe.toml"
CELL = "torch2.14-cu130-py311"
WHEEL = "attnkit_stableext-0.1.0+cu13torch2.13stable.sm80sm90-cp39-abi3-linux_x86_64.whl"
# the keys of matrix.yaml's torch >= 2.13 with a CUDA 13.x build (2.13, 2.14: 13.0; 2.15: 13.0, 13.2)
KEYS = ["cu13torch2.13cxx11abiTRUE", "cu13torch2.14cxx11abiTRUE", "cu13torch2.15cxx11abiTRUE"]
OP = ("import torch, attnkit_stableext, importlib.metadata as md;"
      "print(torch.__version__, md.version('attnkit-stableext'), "
      "torch.ops.attnkit_stableext.scale(torch.arange(4.0), 3.0).tolist(), attnkit_stableext._C.__file__)")


def _uv(py: str) -> str:
    uv = Path(py).parent / "uv"
    assert uv.is_file(), f"uv is not in {Path(py).parent} (nox -s e2e installs it)"
    return str(uv)


@pytest.fixture(scope="module")
def torch213(tmp_path_factory) -> str:
    """A venv with torch 2.13.0, the CPU build (a local file on this machine): the second torch minor."""
    venv = tmp_path_factory.mktemp("torch213") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    fpy = str(venv / "bin" / "python")
    r = subprocess.run([fpy, "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return fpy


@pytest.fixture(scope="module")
def stable_built(py, cache, torch213, tmp_path_factory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("stable")
    r = attnkit(py, cache, "wheels", "build", "--recipe", str(RECIPE), "--cell", CELL, "--python", py,
                "--toolkit", "pypi", "--out", str(base / "house"), "--build-dir", str(base / "build"),
                "--also-python", torch213)
    return base / "house", json.loads(r.stdout)


@pytest.fixture(scope="module")
def site(stable_built, py, cache, tmp_path_factory) -> Path:
    house, _ = stable_built
    out = tmp_path_factory.mktemp("stable-site") / "site"
    r = attnkit(py, cache, "index", "build", str(house), "--out", str(out))
    assert "indexed 1 wheel(s) of 1 project(s) in 3 index(es)" in r.stdout, r.stdout
    return out


def test_one_abi3_wheel_verified_under_two_torch_minors(stable_built):
    house, rep = stable_built
    assert rep["wheel"] == WHEEL
    assert sorted(p.name for p in house.iterdir()) == [WHEEL, WHEEL + ".verify.json"]
    v = rep["verify"]
    assert v["ok"] and v["problems"] == []
    c = v["checks"]
    assert c["requires_torch"] == ["torch>=2.13"]
    assert c["abi3"] == "ok"
    assert c["archs_found"] == {"attnkit_stableext/_C.abi3.so": ["sm_80", "sm_90"]}
    sym = c["stable_abi"]["attnkit_stableext/_C.abi3.so"]
    assert sym["torch_cxx"] == []  # nothing of torch's C++ ABI ...
    assert {"aoti_torch_library_init_def", "torch_library_impl", "torch_get_mutable_data_ptr"} <= set(sym["c_shim"])
    # libtorch_cpu (the C shim) and no CUDA library of torch's, no shared cudart: it loads under a CPU torch too
    assert "libtorch_cpu.so" in sym["needed"] and not [n for n in sym["needed"] if n.startswith(
        ("libtorch_python", "libtorch_cuda", "libc10_cuda", "libcudart"))], sym["needed"]
    assert c["import_under"] == {"2.14.1+cu130": "ok", "2.13.0+cpu": "ok"}  # ... so it loads under both
    assert c["auditwheel"]["grafted"] == []
    with zipfile.ZipFile(house / WHEEL) as z:
        wheel_file = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
        assert "Tag: cp39-abi3-linux_x86_64" in wheel_file
        needed = z.namelist()
    assert "attnkit_stableext/_C.abi3.so" in needed
    assert rep["sha256"] == hashlib.sha256((house / WHEEL).read_bytes()).hexdigest()


def test_a_cpp_abi_extension_fails_the_stable_symbol_check(tinyext_built, tmp_path):
    """The same nm check on the per-cell tiny extension (torch's C++ API): it names the C++ symbols."""
    from attnkit.wheels.verify import check_stable_symbols, undefined_symbols

    house, rep = tinyext_built
    with zipfile.ZipFile(house / rep["wheel"]) as z:
        so = next(n for n in z.namelist() if n.endswith(".so"))
        path = Path(z.extract(so, tmp_path))
    nm = shutil.which("nm")
    assert nm is not None
    problems, info = check_stable_symbols({so: undefined_symbols(path, nm)})
    assert info[so]["torch_cxx"] and any(s.startswith(("c10::", "at::", "torch::")) for s in info[so]["torch_cxx"])
    assert problems[0].startswith(f"{so} needs torch's C++ ABI, which a stable-ABI wheel must not: ")
    assert problems[-1].startswith("no shared object uses torch's stable C shim")


def test_indexed_under_every_key_it_serves(stable_built, site):
    _, rep = stable_built
    keys = sorted(p.name for p in site.iterdir() if p.name.startswith("cu"))
    assert keys == KEYS  # not cu13torch2.12 (below its floor), not a cu12 key (another CUDA major)
    link = f"{WHEEL.replace('+', '%2B')}#sha256={rep['sha256']}"
    for key in KEYS:
        page = (site / key / "simple" / "attnkit-stableext" / "index.html").read_text()
        assert link in page and 'data-requires-python="&gt;=3.9"' in page
    assert link in (site / "stable" / "simple" / "attnkit-stableext" / "index.html").read_text()
    table = {row["key"]: row for row in json.loads((site / "keys.json").read_text())}
    assert sorted(table) == KEYS and all(row["projects"] == ["attnkit-stableext"] for row in table.values())
    assert sorted(p.name for p in (site / "files").iterdir()) == [WHEEL, WHEEL + ".metadata"]  # one file


def test_pip_and_uv_install_it_under_two_torch_minors(site, py, cache, torch213, tmp_path):
    uv = _uv(py)
    index213 = (site / KEYS[0] / "simple").as_uri()
    # torch 2.13.0 (CPU): uv, then pip, each from that key's index, torch resolved as installed
    for tool in ("uv", "pip"):
        cmd = ([uv, "pip", "install", "--python", torch213, "attnkit-stableext", "--index-url", index213]
               if tool == "uv" else
               [torch213, "-m", "pip", "install", "-q", "--disable-pip-version-check", "attnkit-stableext",
                "--index-url", index213])
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{tool}: {r.stderr[-2000:]}"
        out = subprocess.run([torch213, "-W", "ignore", "-c", OP], capture_output=True, text=True, check=True).stdout
        assert out.startswith("2.13.0+cpu 0.1.0+cu13torch2.13stable.sm80sm90 [0.0, 3.0, 6.0, 9.0]"), (tool, out)
        subprocess.run([uv, "pip", "uninstall", "--python", torch213, "attnkit-stableext"], capture_output=True,
                       check=True)
    # torch 2.14.1 (CUDA 13.0): `attnkit install` picks it for the key it has no cell wheel for (pip), and uv
    fpy, fresh_site = fresh_venv(tmp_path / "fresh", py)
    r = attnkit(py, cache, "wheel-url", "attnkit-stableext", "--index", str(site), "--python", fpy)
    assert r.stdout.strip().endswith(WHEEL.replace("+", "%2B") + "#sha256=" + r.stdout.strip().rsplit("=", 1)[1])
    assert f"{KEYS[1]}/simple" in r.stderr  # the install commands name the environment's own key
    r = attnkit(py, cache, "install", "attnkit-stableext", "--index", str(site), "--python", fpy)
    assert r.stdout.startswith(f"installed {WHEEL} (sha256 ") and "torch stays 2.14.1+cu130" in r.stdout
    out = subprocess.run([fpy, "-W", "ignore", "-c", OP], capture_output=True, text=True, check=True).stdout
    assert out.startswith("2.14.1+cu130 0.1.0+cu13torch2.13stable.sm80sm90 [0.0, 3.0, 6.0, 9.0]") and fresh_site in out
    upy, uv_site = fresh_venv(tmp_path / "fresh-uv", py)
    r = subprocess.run([uv, "pip", "install", "--python", upy, "--no-deps", "attnkit-stableext", "--index-url",
                        (site / KEYS[1] / "simple").as_uri()], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = subprocess.run([upy, "-W", "ignore", "-c", OP], capture_output=True, text=True, check=True).stdout
    assert out.startswith("2.14.1+cu130 0.1.0+cu13torch2.13stable.sm80sm90 [0.0, 3.0, 6.0, 9.0]") and uv_site in out


def test_a_torch_below_its_floor_is_refused_with_the_reason(site, py, cache, tmp_path):
    venv = tmp_path / "torch212"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    fpy = str(venv / "bin" / "python")
    whl = fake_torch(tmp_path, "2.12.1", "13.0", module_version="2.12.1+cu130")
    subprocess.run([fpy, "-m", "pip", "install", "-q", "--no-index", str(whl)], check=True)
    for cmd in ("install", "wheel-url"):
        r = attnkit(py, cache, cmd, "attnkit-stableext", "--index", str(site), "--python", fpy, check=False)
        one_line_error(r, f"attnkit-stableext: its stable-ABI wheel {WHEEL} needs torch >= 2.13",
                       "this environment has torch 2.12.1+cu130", "upgrade torch to 2.13 or newer")
    r = subprocess.run([fpy, "-c", "import importlib.util as u; print(u.find_spec('attnkit_stableext'))"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "None"
