"""The CPU cell's runtime image, built here from the real Dockerfile with the pipeline's hashed wheelhouse
(torch CPU, attnkit, nox), on a Debian base made with debootstrap (no registry is reachable), with
podman (no Docker engine). Checks: non-root, labels, no compiler/pip/wheelhouse in the runtime image, size
within base + environment + 5%, the smoke target runs `nox -s smoke` inside it, a tampered wheel fails the
build with a clear error, and a rebuild with nothing changed reuses every layer.

Run by `nox -s e2e` (root, with podman, buildah and debootstrap installed by .ci/run).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnkit.images import build as ib
from attnkit.images.base import local_base
from attnkit.images.wheelhouse import build_wheelhouse
from attnkit.matrix import load_matrix
from attnkit.matrix.expand import find_cell

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CELL = "torch2.13-cpu-py311"
CONTEXT_FILES = ("noxfile.py", "pyproject.toml")


REPORT: dict = {}


@pytest.fixture(scope="module", autouse=True)
def image_report():
    """With ATTNKIT_IMAGE_REPORT=path, write what these tests measured (docs/results/<date>-image-cpu.json)."""
    yield REPORT
    path = os.environ.get("ATTNKIT_IMAGE_REPORT")
    if path and REPORT:
        Path(path).write_text(json.dumps(REPORT, indent=1, default=str))


@pytest.fixture(scope="module")
def env():
    for tool in ("podman", "buildah", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: .ci/run installs podman, buildah and debootstrap")
    m = load_matrix(ROOT / "matrix.yaml")
    cell = find_cell(m, CELL)
    return m, cell, local_base(m, cell, "runtime")


def _image_ids() -> set[str]:
    out = subprocess.run(["podman", "images", "-a", "-q", "--no-trunc"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.fixture(scope="module", autouse=True)
def _remove_what_we_built(env):
    """Each run's images (new revision label, new wheelhouse) would leave the last run's as dangling layers, gigabytes
    a run, until a machine that keeps its store between runs fills its disk: remove every image this module made, except
    the debootstrap base, which `env` made or found and later runs reuse."""
    before = _image_ids()
    yield
    new = sorted(_image_ids() - before)
    if new:
        subprocess.run(["podman", "rmi", "-f", *new], capture_output=True, check=False)
    left = _image_ids() & set(new)
    assert not left, f"podman could not remove {len(left)} image(s) this module built"


@pytest.fixture(scope="module")
def context(tmp_path_factory, env) -> Path:
    _, cell, _ = env
    ctx = tmp_path_factory.mktemp("context")
    for f in CONTEXT_FILES:
        (ctx / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / f, ctx / f)
    build_wheelhouse(cell, ctx / "wheelhouse")
    return ctx


@pytest.fixture(scope="module")
def built(env, context, tmp_path_factory):
    m, cell, base = env
    subprocess.run(["podman", "rmi", "-f", cell.image_tags["runtime"][0]], capture_output=True)
    logs = tmp_path_factory.mktemp("logs")
    first = ib.build_image(m, cell, "runtime", base_image=base, builder="podman", context=context,
                           log=logs / "first.log")
    second = ib.build_image(m, cell, "runtime", base_image=base, builder="podman", context=context,
                            log=logs / "second.log")
    osrep = ib.build_image(m, cell, "runtime", target="os", base_image=base, builder="podman", context=context,
                           tag="localhost/attnkit-test:os")
    base_size = ib.image_size("podman", base)
    REPORT.update(
        date=time.strftime("%Y-%m-%d"), cell=CELL, builder="podman (chroot isolation)", base_image=base,
        machine="2-core CI/dev machine, no Docker engine, no registry access",
        first_build_seconds=first.seconds, rebuild_seconds=second.seconds,
        rebuild_cache_hits=second.cache_hits, image_bytes=first.size_bytes,
        layer_groups={"base image": base_size,
                      "os stage: distro Python + user": (osrep.size_bytes or 0) - (base_size or 0),
                      "environment (/opt/venv)": next((h["size"] for h in first.history
                                                       if "COPY" in h["created_by"] and "in /opt/venv" in h["created_by"]),
                                                      None),
                      "attnkit smoke files": sum(h["size"] or 0 for h in first.history
                                                 if "COPY" in h["created_by"] and "/opt/attnkit" in h["created_by"])},
        history=first.history)
    return first, second, osrep, logs


def test_runtime_image_is_non_root_labelled_and_lean(built, env):
    first, _, _, _ = built
    _, cell, _ = env
    ref = first.tag
    assert ib.run_in_image(ref, "id", "-u").stdout.strip() == "10001"
    labels = json.loads(subprocess.run(["podman", "image", "inspect", ref], capture_output=True, text=True,
                                       check=True).stdout)[0]["Labels"]
    assert labels["org.attnkit.cell"] == CELL
    assert labels["org.attnkit.torch"] == cell.torch_version
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", labels["org.opencontainers.image.revision"])
    assert labels["org.opencontainers.image.source"].startswith("https://")
    tools = ib.run_in_image(ref, "sh", "-c", "for t in gcc cc c++ g++ clang nvcc make pip pip3; do command -v $t; done")
    assert tools.stdout.strip() == "", f"build tools in the runtime image: {tools.stdout}"
    assert "No module named pip" in ib.run_in_image(ref, "python", "-m", "pip", "--version").stderr
    # nothing of the wheelhouse or pip's cache in any layer (the distro's and virtualenv's own seed wheels are
    # part of installed packages, not leftovers)
    leftovers = ib.run_in_image(ref, "sh", "-c", "ls -d /wheelhouse /root/.cache/pip /home/attnkit/.cache/pip "
                                              "2>/dev/null; find / -xdev \\( -name 'torch-*.whl' -o -name "
                                              "'attnkit-*.whl' -o -name 'pip.whl' \\) -print 2>/dev/null")
    assert leftovers.stdout.strip() == "", leftovers.stdout
    doctor = ib.run_in_image(ref, "python", "-m", "attnkit.cli", "doctor", "--json")
    assert json.loads(doctor.stdout)["backends"]["sdpa_cpu"]["available"]


def test_image_size_is_base_plus_environment(built):
    first, _, osrep, _ = built
    venv = int(ib.run_in_image(first.tag, "du", "-sb", "/opt/venv").stdout.split()[0])
    assert first.size_bytes is not None and osrep.size_bytes is not None
    REPORT.update(venv_bytes=venv, size_limit_bytes=int((osrep.size_bytes + venv) * 1.05),
                  size_over_base_plus_env=first.size_bytes / (osrep.size_bytes + venv))
    # os stage = base + the distro's Python; the venv is the installed environment
    assert first.size_bytes <= (osrep.size_bytes + venv) * 1.05, (first.size_bytes, osrep.size_bytes, venv)


def test_rebuild_with_nothing_changed_reuses_every_layer(built):
    first, second, _, logs = built
    log = (logs / "second.log").read_text()
    steps = re.findall(r"^\[\d/\d\] STEP \d+/\d+: (RUN|COPY)", log, flags=re.M)
    assert steps and second.cache_hits >= len(steps), (second.cache_hits, len(steps))
    assert second.seconds < first.seconds / 2


def test_smoke_target_runs_nox_smoke_inside(env, context, tmp_path):
    m, cell, base = env
    rep = ib.build_image(m, cell, "runtime", target="smoke", base_image=base, builder="podman", context=context,
                         tag="localhost/attnkit-test:smoke", log=tmp_path / "smoke.log")
    log = (tmp_path / "smoke.log").read_text()
    m_ = re.search(r"smoke (\{.*\})", log)
    assert m_, log[-2000:]
    counts = ast.literal_eval(m_.group(1))  # the printed dict of outcome counts
    assert counts.get("passed", 0) > 0 and counts.get("failed", 0) == 0, counts
    REPORT.update(smoke_counts=counts, smoke_build_seconds=rep.seconds)


def test_tampered_wheel_fails_the_build(env, context, tmp_path):
    _, _, base = env
    bad = tmp_path / "ctx"
    shutil.copytree(context, bad)
    victim = next((bad / "wheelhouse").glob("rich-*.whl"))
    victim.write_bytes(victim.read_bytes() + b"tampered")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "images", "build", "--cell", CELL, "--base-image", base, "--builder", "podman",
                        "--context", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    # stderr holds the build's progress lines (the steps it got through), then ONE error line, no traceback
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("attnkit: error:")]
    assert errors == [lines[-1]] and "does not match its sha256 in requirements.txt" in lines[-1], r.stderr
    assert all(ln.startswith("podman build ") for ln in lines[:-1]) and "Traceback" not in r.stderr, r.stderr
    REPORT.update(tampered_wheel_error=lines[-1])
    assert time.monotonic() - t0 < 600


def test_arm64_os_stage_builds_and_runs_under_emulation(env, tmp_path):
    """linux/arm64 (issue 24): the Dockerfile's OS stage for the CPU cell on an arm64 Debian base made here,
    its binaries run through qemu-user-static (`nox -s e2e` registers the handler). The later stages need
    torch's aarch64 CPU wheel, which only download.pytorch.org serves (not reachable here)."""
    m, cell, _ = env
    assert "linux/arm64" in cell.platforms
    base = local_base(m, cell, "runtime", "linux/arm64")
    arch = subprocess.run(["podman", "image", "inspect", "--format", "{{.Architecture}}", base],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert base.endswith("-arm64") and arch == "arm64"
    rep = ib.build_image(m, cell, "runtime", target="os", base_image=base, builder="podman", context=tmp_path,
                         tag="localhost/attnkit-test:os-arm64", platform="linux/arm64")
    assert rep.platform == "linux/arm64" and rep.size_bytes
    (tmp_path / "Containerfile").write_text(
        "FROM localhost/attnkit-test:os-arm64\n"
        "RUN python3.11 -c \"import platform; print('machine=' + platform.machine())\" && id -u attnkit\n")
    r = subprocess.run(["podman", "build", "--isolation", "chroot", "--platform", "linux/arm64", "--no-cache",
                        "-t", "localhost/attnkit-test:os-arm64-check", str(tmp_path)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "machine=aarch64" in r.stdout and "\n10001\n" in r.stdout
    REPORT["arm64_os_stage"] = {"base": base, "seconds": rep.seconds, "bytes": rep.size_bytes}
