"""The doctor and the smoke on machines where they are needed most (issue 27, items 11-13): torch installed but
broken, a CPU-only torch, and a smoke that would check nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.errors import torch_import_failure

ROOT = Path(__file__).resolve().parents[1]


def attnkit(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_BACKEND"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, str(ROOT / "src")])
    return subprocess.run([sys.executable, "-m", "attnkit.cli", *args], capture_output=True, text=True, env=env,
                          check=False, timeout=300)


@pytest.fixture
def broken_torch(tmp_path: Path) -> str:
    """A torch whose import fails the way a missing cuDNN does."""
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise OSError("libcudnn.so.9: cannot open shared object file: '
                                     'No such file or directory")\n')
    return str(tmp_path)


def test_doctor_names_the_missing_library_and_exits_1(broken_torch: str) -> None:
    r = attnkit("doctor", pythonpath=broken_torch)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "BROKEN" in out and "libcudnn.so.9 is missing" in out
    assert out.count("no attention backend can run") <= 2  # not once per shape
    rep = json.loads(attnkit("doctor", "--json", pythonpath=broken_torch).stdout)
    assert "libcudnn.so.9" in rep["probe"]["torch_error"] and not rep["healthy"]
    assert all(not b["available"] and "does not import" in b["reasons"][0] for b in rep["backends"].values())


def test_smoke_with_a_broken_torch_fails_and_says_why(broken_torch: str) -> None:
    r = attnkit("smoke", pythonpath=broken_torch)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "does not import" in r.stdout and "no check ran" in r.stdout


def test_torch_import_diagnoses() -> None:
    assert "undefined symbol _ZN3c10" in torch_import_failure(
        "ImportError: /x/libtorch_cuda.so: undefined symbol _ZN3c10")
    assert "torch/CUDA mismatch" in torch_import_failure("ImportError: x.so: undefined symbol: _ZN3c104cuda")
    assert torch_import_failure("RuntimeError: boom\nmore").endswith("does not import: RuntimeError: boom")


def test_doctor_on_a_cpu_torch_does_not_call_cuda_backends_available() -> None:
    pytest.importorskip("torch")
    rep = json.loads(attnkit("doctor", "--json").stdout)
    if rep["device"] != "cpu":
        pytest.skip("this machine runs attention on a GPU")
    for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "torch_varlen", "sdpa_cudnn_varlen"):
        assert not rep["backends"][name]["available"], name
        assert "this machine runs attention on cpu" in "; ".join(rep["backends"][name]["reasons"])
    assert rep["backends"]["sdpa_math"]["available"]


def test_a_smoke_that_checks_nothing_fails_with_the_reasons_grouped() -> None:
    pytest.importorskip("torch")
    r = attnkit("smoke", "--backend", "sdpa_cudnn", "--case", "mha", "--case", "gqa")
    if "0 passed" not in r.stdout:
        pytest.skip("sdpa_cudnn runs here")
    assert r.returncode == 1
    assert "no check ran" in r.stdout
    assert any(line.strip().startswith("skipped 2x: sdpa_cudnn: runs on cuda") for line in r.stdout.splitlines())


def test_index_key_of_an_interpreter_with_a_broken_torch_says_broken_not_missing(broken_torch: str,
                                                                                   tmp_path: Path) -> None:
    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={broken_torch} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    r = attnkit("index", "key", "--python", str(wrapper))
    assert r.returncode == 1 and "libcudnn.so.9 is missing" in r.stderr and "torch is not installed" not in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
