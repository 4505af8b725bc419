"""Sharded builds, end to end with real nvcc: a wheel's compile units split over shard jobs (separate build
trees, one object store), then gathered and linked by a link job, must give what an unsharded build gives:
the same files, the same exported symbols, cubins for the same archs, a verified wheel whose op runs. A
re-run with nothing changed compiles nothing; a stale object is never linked.

Two extensions: the tinyext fixture (3 units), and a synthetic one with 13 units written here.
Run by `nox -s e2e` (ATTNKIT_E2E_PYTHON: a venv with the CUDA cell's torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from test_wheel_pipeline import CELL, RECIPE, attnkit

pytestmark = pytest.mark.e2e

KERNELS = 12  # synthetic extension: 12 .cu units + one .cpp registering an op that launches them all


def synthetic_extension(root: Path, kernels: int = KERNELS) -> Path:
    """An extension of `kernels` CUDA units (each adds its own constant) and one op that runs them all:
    attnkit_synth::add_all(x) = x + sum(1..kernels) on CPU and CUDA. Returns its recipe."""
    (root / "csrc").mkdir(parents=True)
    (root / "attnkit_synth").mkdir()
    (root / "attnkit_synth" / "__init__.py").write_text("import torch\n\nfrom . import _C  # noqa: F401\n")
    decls, calls = [], []
    for i in range(1, kernels + 1):
        (root / "csrc" / f"k{i:02d}.cu").write_text(
            "#include <cuda_runtime.h>\n#include <cstdint>\n"
            f"__global__ void k{i}(float* y, int64_t n) {{ int64_t j = blockIdx.x * (int64_t)blockDim.x + "
            f"threadIdx.x; if (j < n) y[j] += {i}.0f; }}\n"
            f"void launch_k{i}(float* y, int64_t n, cudaStream_t s) {{ if (n) k{i}<<<(unsigned)((n + 255) / 256), "
            "256, 0, s>>>(y, n); }\n")
        decls.append(f"void launch_k{i}(float* y, int64_t n, cudaStream_t s);")
        calls.append(f"  launch_k{i}(y.data_ptr<float>(), y.numel(), st);")
    (root / "csrc" / "ops.cpp").write_text("\n".join([
        "#include <ATen/ATen.h>", "#include <c10/cuda/CUDAStream.h>", "#include <torch/library.h>",
        "#include <Python.h>", *decls,
        f"static at::Tensor add_all_cpu(const at::Tensor& x) {{ return x + {kernels * (kernels + 1) // 2}; }}",
        "static at::Tensor add_all_cuda(const at::Tensor& x) {", "  auto y = x.contiguous().clone();",
        "  auto st = c10::cuda::getCurrentCUDAStream();", *calls, "  return y;", "}",
        'TORCH_LIBRARY(attnkit_synth, m) { m.def("add_all(Tensor x) -> Tensor"); }',
        'TORCH_LIBRARY_IMPL(attnkit_synth, CPU, m) { m.impl("add_all", &add_all_cpu); }',
        'TORCH_LIBRARY_IMPL(attnkit_synth, CUDA, m) { m.impl("add_all", &add_all_cuda); }',
        'static PyModuleDef def_ = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};',
        "PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&def_); }", ""]))
    sources = ", ".join(f'"csrc/k{i:02d}.cu"' for i in range(1, kernels + 1))
    (root / "setup.py").write_text(
        "from setuptools import setup\nfrom torch.utils.cpp_extension import BuildExtension, CUDAExtension\n"
        'setup(name="attnkit-synth", version="0.1.0", packages=["attnkit_synth"],\n'
        f'      ext_modules=[CUDAExtension("attnkit_synth._C", ["csrc/ops.cpp", {sources}])],\n'
        '      cmdclass={"build_ext": BuildExtension}, install_requires=["torch"], python_requires=">=3.10")\n')
    recipe = root / "recipe.toml"
    recipe.write_text('name = "attnkit-synth"\nextension_modules = ["attnkit_synth._C"]\n'
                      'import_modules = ["attnkit_synth"]\n\n[source]\npath = "."\nversion = "0.1.0"\n'
                      'archs = ["9.0"]\n\n[build]\narch_env = "TORCH_CUDA_ARCH_LIST"\narch_format = "dotted-semicolon"\n'
                      'jobs_env = "MAX_JOBS"\nnvcc_threads = 1\nmemory_per_job_gib = 1.5\n\n[build.unit_cost]\n'
                      '"csrc/ops.cpp" = 6.0\n')
    return recipe


def build(py: str, cache: Path, recipe: Path, work: Path, *extra: str, check: bool = True):
    return attnkit(py, cache, "wheels", "build", "--recipe", str(recipe), "--cell", CELL, "--python", py,
                   "--toolkit", "pypi", "--out", str(work / "house"), "--build-dir", str(work / "build"), *extra,
                   check=check)


def sharded(py: str, cache: Path, recipe: Path, root: Path, n: int) -> tuple[list[dict], dict]:
    """n shard jobs, each in a build tree of its own, then the link job in another: like n+1 CI runners."""
    store = root / "objects"
    shards = []
    for i in range(1, n + 1):
        r = build(py, cache, recipe, root / f"shard{i}", "--shard", f"{i}/{n}", "--objects", str(store))
        shards.append(json.loads(r.stdout))
    r = build(py, cache, recipe, root / "link", "--link-only", "--objects", str(store))
    return shards, json.loads(r.stdout)


def exported(so: bytes, tmp: Path) -> set[str]:
    path = tmp / "lib.so"
    path.write_bytes(so)
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {ln.split()[-1] for ln in out.stdout.splitlines() if ln.strip()}


def compare(a: Path, b: Path, tmp: Path) -> None:
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        assert sorted(za.namelist()) == sorted(zb.namelist())
        libs = [n for n in za.namelist() if n.endswith(".so")]
        assert libs
        for lib in libs:
            assert exported(za.read(lib), tmp) == exported(zb.read(lib), tmp), lib


def run_op(py: str, wheel: Path, tmp: Path, code: str) -> str:
    target = tmp / "site"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True)
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(target)))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


@pytest.mark.parametrize("which", ["tinyext", "synthetic"])
def test_sharded_build_equals_unsharded(py, cache, tmp_path, which, request):
    if which == "tinyext":
        recipe, n, op = RECIPE, 3, "import torch, attnkit_tinyext; print(torch.ops.attnkit_tinyext.scale(torch.ones(3), 2.0).tolist())"
        want = "[2.0, 2.0, 2.0]"
    else:
        recipe = synthetic_extension(tmp_path / "src")
        n, op = 3, "import torch, attnkit_synth; print(torch.ops.attnkit_synth.add_all(torch.zeros(2)).tolist())"
        want = f"[{KERNELS * (KERNELS + 1) / 2}, {KERNELS * (KERNELS + 1) / 2}]"
    plan = json.loads(attnkit(py, cache, "wheels", "plan", "--recipe", str(recipe), "--cell", CELL, "--python", py,
                              "--toolkit", "pypi", "--build-dir", str(tmp_path / "plan"), "--shards", str(n),
                              "--json").stdout)
    units = plan["units"]
    assert units == (3 if which == "tinyext" else KERNELS + 1)
    assert sorted(u for s in plan["plan"] for u in s["units"]) == sorted({u for s in plan["plan"] for u in s["units"]})
    if which == "synthetic":  # balanced by cost: ops.cpp (cost 6) alone in a shard, the 12 kernels over the rest
        assert plan["plan"][0]["units"] == ["csrc/ops.cpp"]
        assert [s["cost"] for s in plan["plan"]] == [6.0, 6.0, 6.0]

    if which == "tinyext":  # the unsharded build the wheel pipeline's tests check too (conftest.py)
        whole_house, whole = request.getfixturevalue("tinyext_built")
    else:
        whole = json.loads(build(py, cache, recipe, tmp_path / "whole").stdout)
        whole_house = tmp_path / "whole" / "house"
    shards, linked = sharded(py, cache, recipe, tmp_path / "sharded", n)
    assert [s["wheel"] for s in shards] == [None] * n  # shard jobs link nothing
    assert sum(s["shard"]["compiled"] for s in shards) == units  # every unit compiled exactly once
    assert [s["shard"]["shard_units"] for s in shards] == [p["units"] for p in plan["plan"]]
    assert linked["shard"]["restored"] == units and linked["objects_compiled_this_run"] == 0
    assert linked["wheel"] == whole["wheel"] and linked["verify"]["ok"]
    assert linked["verify"]["checks"]["archs_found"] == whole["verify"]["checks"]["archs_found"]
    compare(whole_house / whole["wheel"], tmp_path / "sharded" / "link" / "house" / linked["wheel"], tmp_path)
    assert run_op(py, tmp_path / "sharded" / "link" / "house" / linked["wheel"], tmp_path, op) == want

    if which == "tinyext":  # a re-run with nothing changed (CI restoring the cached store) compiles nothing:
        for i in (1, n):  # the first shard and the last (each re-run is a full setup.py run: ~15 s)
            again = json.loads(build(py, cache, recipe, tmp_path / "again" / str(i), "--shard", f"{i}/{n}",
                                     "--objects", str(tmp_path / "sharded" / "objects")).stdout)
            assert again["shard"]["compiled"] == 0 and again["shard"]["restored"] == len(again["shard"]["shard_units"])
            assert again["objects_compiled_this_run"] == 0


def test_stale_objects_are_never_linked(py, cache, tmp_path):
    """Objects compiled for other inputs (here: another arch list) have other keys: the link job finds them
    missing and says so in one line, instead of linking them."""
    store = tmp_path / "objects"
    build(py, cache, RECIPE, tmp_path / "s1", "--shard", "1/1", "--objects", str(store), "--archs", "90")
    r = build(py, cache, RECIPE, tmp_path / "link", "--link-only", "--objects", str(store), check=False)
    # the two .cu units were compiled for sm_90 only; ops.cpp has no arch flags, so its object is the same one
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("attnkit: error: link: 2 of 3 objects are not in the object store"), r.stderr
    assert "csrc/add_one.cu, csrc/scale.cu" in last and "run every shard" in last
    assert not (tmp_path / "link" / "house").exists() or not list((tmp_path / "link" / "house").iterdir())


def test_shard_arguments_are_checked(py, cache, tmp_path):
    for bad in ("0/3", "4/3", "x"):
        r = build(py, cache, RECIPE, tmp_path, "--shard", bad, "--objects", str(tmp_path), check=False)
        assert r.returncode == 2 and "--shard: expected I/N" in r.stderr
    r = build(py, cache, RECIPE, tmp_path, "--shard", "1/2", check=False)
    assert r.returncode == 2 and "--objects: required" in r.stderr
