"""End to end, with real compilation: a tiny CUDA extension (tests/fixtures/tinyext: two .cu kernels and a
.cpp registering torch ops) goes through the SAME driver as flash-attn: nvcc build against a CUDA build of
torch with a toolkit provisioned from PyPI, verify (archs via cuobjdump, import, torch pin, auditwheel),
naming, index, then `attnkit install` from that index into a fresh venv, and the op runs.

Run by `nox -s e2e`, which makes a venv with the CUDA cell's torch and sets ATTNKIT_E2E_PYTHON to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests" / "fixtures" / "tinyext" / "recipe.toml"
CELL = "torch2.14-cu130-py311"  # matches nox -s e2e's torch==2.14.1 (CUDA 13.0) on Python 3.11
WHEEL = "attnkit_tinyext-0.1.0+cu13torch2.14cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"


def attnkit(py: str, cache: Path, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ATTNKIT_CACHE_DIR=str(cache))
    env.pop("CUDA_HOME", None)
    r = subprocess.run([py, "-m", "attnkit.cli", *args], capture_output=True, text=True, env=env, **kw)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def build_args(out: Path, build_dir: Path, py: str) -> list[str]:
    return ["wheels", "build", "--recipe", str(RECIPE), "--cell", CELL, "--python", py, "--toolkit", "pypi",
            "--out", str(out), "--build-dir", str(build_dir)]


def test_build_is_verified_and_named(tinyext_built):
    house, rep = tinyext_built
    assert rep["wheel"] == WHEEL
    assert sorted(p.name for p in house.iterdir()) == [WHEEL, WHEEL + ".verify.json"]
    v = rep["verify"]
    assert v["ok"] and v["problems"] == []
    assert v["checks"]["archs_expected"] == ["sm_80", "sm_90"]
    assert list(v["checks"]["archs_found"].values()) == [["sm_80", "sm_90"]]
    assert v["checks"]["requires_torch"] == ["torch<2.15,>=2.14"]
    assert v["checks"]["import"] == "ok"
    assert v["checks"]["auditwheel"]["grafted"] == [] and v["checks"]["auditwheel"]["policy"].startswith("manylinux_")
    assert rep["sha256"] == hashlib.sha256((house / WHEEL).read_bytes()).hexdigest() == v["sha256"]
    assert rep["objects_compiled_this_run"] == 3 and rep["objects_total"] == 3
    assert rep["jobs"] >= 1 and "limited by" in rep["jobs_reason"]
    assert "PyPI toolkit wheels 13.0" in rep["toolkit"]


def fresh_venv(path: Path, py: str) -> tuple[str, str]:
    """A new venv that sees the cell's torch through a .pth file, and nothing else of ours."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    cell_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    fpy = str(path / "bin" / "python")
    fresh_site = subprocess.run([fpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    Path(fresh_site, "cell-torch.pth").write_text(cell_site + "\n")
    return fpy, fresh_site


def test_index_then_install_into_a_fresh_venv(tinyext_built, py, cache, tmp_path):
    house, rep = tinyext_built
    site = tmp_path / "site"
    attnkit(py, cache, "index", "build", str(house), "--out", str(site))
    key = WHEEL.split("+")[1].split("-")[0]
    assert key == "cu13torch2.14cxx11abiTRUE"
    page = (site / key / "simple" / "attnkit-tinyext" / "index.html").read_text()
    assert f"{WHEEL.replace('+', '%2B')}#sha256={rep['sha256']}" in page
    fpy, fresh_site = fresh_venv(tmp_path / "fresh", py)
    assert attnkit(py, cache, "index", "key", "--python", fpy).stdout.strip() == key  # the real CUDA torch's key
    r = attnkit(py, cache, "wheel-url", "attnkit-tinyext", "--index", str(site), "--python", fpy)
    assert r.stdout.strip().endswith(f"{WHEEL.replace('+', '%2B')}#sha256={rep['sha256']}")
    attnkit(py, cache, "install", "attnkit-tinyext", "--index", str(site), "--python", fpy)
    code = ("import torch, attnkit_tinyext, importlib.metadata as md; x = torch.arange(4.0);"
            "print(md.version('attnkit-tinyext'), torch.ops.attnkit_tinyext.scale(x, 3.0).tolist(),"
            " torch.ops.attnkit_tinyext.add_one(x).tolist(), attnkit_tinyext.__file__)")
    out = subprocess.run([fpy, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "0.1.0+cu13torch2.14cxx11abitrue" in out.lower()
    assert "[0.0, 3.0, 6.0, 9.0] [1.0, 2.0, 3.0, 4.0]" in out and fresh_site in out


def test_tampered_wheel_in_index_is_refused(tinyext_built, py, cache, tmp_path):
    house, _ = tinyext_built
    site = tmp_path / "site"
    attnkit(py, cache, "index", "build", str(house), "--out", str(site))
    target = site / "files" / WHEEL
    target.write_bytes(target.read_bytes() + b"\0")
    fpy, _ = fresh_venv(tmp_path / "fresh", py)
    r = attnkit(py, cache, "install", "attnkit-tinyext", "--index", str(site), "--python", fpy, check=False)
    assert r.returncode == 1
    assert r.stderr.startswith(f"attnkit: error: {WHEEL}: hash mismatch: the index says sha256")
    assert len(r.stderr.strip().splitlines()) == 1


def test_interrupted_build_resumes(py, cache, tmp_path):
    out, bdir = tmp_path / "house", tmp_path / "build"
    env = dict(os.environ, ATTNKIT_CACHE_DIR=str(cache))
    proc = subprocess.Popen([py, "-m", "attnkit.cli", *build_args(out, bdir, py), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = bdir / "build.log"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # stop it right after the first object is compiled
        if log.is_file() and "[1/3]" in log.read_text(errors="replace"):
            break
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 130, proc.stderr.read() if proc.stderr else ""
    assert not out.exists() or list(out.iterdir()) == []  # nothing half-written
    time.sleep(1)
    survivors = []  # no compiler of that build keeps running (ninja gives each its own process group)
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(bdir) in cmdline.read_bytes().decode(errors="replace"):
                survivors.append(cmdline.parent.name)
        except OSError:
            continue
    assert survivors == [], survivors
    objects = list((bdir / "src" / "build").rglob("*.o"))
    assert len(objects) >= 1
    r = attnkit(py, cache, *build_args(out, bdir, py), "--jobs", "1")
    rep = json.loads(r.stdout)
    assert 1 <= rep["objects_compiled_this_run"] < 3, rep  # resumed: the finished object was not rebuilt
    assert rep["verify"]["ok"] and (out / WHEEL).is_file()


def test_arch_subset_test_build(py, cache, tmp_path):
    """`--archs 90`: what the H200 run uses to build one arch in minutes; the wheel is marked and verified
    for exactly that arch."""
    r = attnkit(py, cache, *build_args(tmp_path / "house", tmp_path / "build", py), "--archs", "90")
    rep = json.loads(r.stdout)
    assert rep["wheel"] == WHEEL.replace("cxx11abiTRUE-", "cxx11abiTRUE.sm90-")
    assert rep["verify"]["ok"] and rep["verify"]["checks"]["archs_expected"] == ["sm_90"]
    assert list(rep["verify"]["checks"]["archs_found"].values()) == [["sm_90"]]


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> None:
    assert r.returncode == code, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs(py, cache, tmp_path):
    out = tmp_path / "house"
    args = build_args(out, tmp_path / "b", py)
    r = attnkit(py, cache, *[a if a != CELL else "torch2.14-cu131-py311" for a in args], check=False)
    one_line_error(r, "--cell: unknown cell 'torch2.14-cu131-py311'", "did you mean", code=2)
    r = attnkit(py, cache, *[a if a != "pypi" else str(tmp_path / "nowhere") for a in args], check=False)
    one_line_error(r, "toolkit: --toolkit", "has no bin/nvcc")
    stub = tmp_path / "cuda12" / "bin"
    stub.mkdir(parents=True)
    (stub / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    (stub / "nvcc").chmod(0o755)
    r = attnkit(py, cache, *[a if a != "pypi" else str(stub.parent) for a in args], check=False)
    one_line_error(r, "is CUDA 12.8", "built with CUDA 13.0", "majors must match")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "notorch")], check=True)
    r = attnkit(py, cache, *[a if a != py else str(tmp_path / "notorch" / "bin" / "python") for a in args],
                check=False)
    one_line_error(r, "does not match cell torch2.14-cu130-py311", "no torch in")
    assert not out.exists()


def test_cibuildwheel_reads_our_config(py, tmp_path):
    """cibuildwheel itself parses wheels/cibuildwheel.toml (it rejects unknown options) and selects the job's
    build identifier; the container run needs Docker, which this machine lacks (see the CI workflow)."""
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup(name='x', version='1')\n")
    cfg = ROOT / "wheels" / "cibuildwheel.toml"
    env = dict(os.environ, CIBW_BUILD="cp312-manylinux_x86_64")
    r = subprocess.run([py, "-m", "cibuildwheel", "--print-build-identifiers", "--platform", "linux",
                        "--config-file", str(cfg), str(tmp_path)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cp312-manylinux_x86_64"]
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace("build-verbosity", "bild-verbosity"))
    r = subprocess.run([py, "-m", "cibuildwheel", "--print-build-identifiers", "--platform", "linux",
                        "--config-file", str(bad), str(tmp_path)], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "bild-verbosity" in r.stderr
