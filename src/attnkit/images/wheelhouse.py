"""The hermetic wheelhouse an image is built from: the cell's torch with its full dependency closure, the
cell's verified attnkit-built wheels, the PyPI-published libraries it takes as they are (FlashAttention-4 with
its CuTe DSL libraries for the cell's CUDA major), attnkit itself, and nox (so `nox -s smoke` runs in the image),
for the cell's Python and platform. `requirements.txt` pins every file by sha256, so the image's install
step runs offline with --require-hashes and a tampered file fails the build.

Layout (the Dockerfile relies on it):
  wheelhouse/*.whl, requirements.txt      the runtime environment
  wheelhouse/pip/pip.whl                  pip, run from its wheel, never installed into the image
  wheelhouse/devel/*.whl, requirements.txt  extra build tools for the devel variant
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import parse_wheel_filename

from attnkit.errors import AttnkitError
from attnkit.images.context import source_tree
from attnkit.matrix import naming
from attnkit.matrix.expand import Cell, PackageBuild
from attnkit.wheels.pyenv import torch_requirement

PIP_VERSION = "26.3"
NOX_VERSION = "2026.10.20"
# cuDNN's Python graphs, for the cudnn_ragged varlen backend (CUDA cells only). Taken without its declared
# dependencies (nvidia-cutlass-dsl[cu13], apache-tvm-ffi: only its optional CuTe-DSL kernels use them; the
# cuDNN graphs load libcudnn from torch's own nvidia-cudnn wheel), as checked on the H200 (docs/results).
CUDNN_FRONTEND_VERSION = "1.32.0"
DEVEL_TOOLS = ("setuptools", "wheel", "ninja", "packaging", "psutil")


# The oldest glibc among the images' bases: Debian 12 (2.36); Ubuntu 24.04, under nvidia/cuda, has 2.39.
BASE_GLIBC = (2, 36)


def _platform_args(cell: Cell) -> list[str]:
    """pip download's view of the image: every manylinux tag its glibc runs (NCCL's wheels are 2_18, torch's
    2_28, others 2_17 or 2_34), for the cell's CPython."""
    plats = [f"manylinux_{BASE_GLIBC[0]}_{m}_x86_64" for m in range(BASE_GLIBC[1], 16, -1)]
    plats += ["manylinux2014_x86_64", "linux_x86_64"]
    return ["--only-binary=:all:", "--python-version", cell.python, "--implementation", "cp",
            "--abi", naming.cpython_tag(cell.python), *[x for p in plats for x in ("--platform", p)]]


def _pip(args: list[str], what: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        last = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("ERROR")] or r.stderr.strip().splitlines()
        raise AttnkitError(f"wheelhouse: {what} failed: {(last or ['?'])[-1][:300]}")


def requirements_for(folder: Path) -> str:
    """`name==version --hash=sha256:...` for every wheel in a folder."""
    lines = []
    for whl in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(whl.name)
        sha = hashlib.sha256(whl.read_bytes()).hexdigest()
        lines.append(f"{name}=={version} --hash=sha256:{sha}")
    return "\n".join(lines) + "\n"


def cell_wheel(pkg: PackageBuild, wheels: Path | None, test_builds: bool) -> Path:
    """The verified wheel of `pkg` in `wheels`: the cell's own, or with `test_builds` a build for fewer archs
    (`attnkit wheels build --archs`, named '+...TRUE.sm90'), which the image then carries marked as such."""
    if wheels is not None:
        exact = wheels / pkg.wheel
        found = [exact] if exact.is_file() else []
        if not found and test_builds:
            name, version, rest = pkg.wheel.split("-", 2)
            public, _, local = version.partition("+")
            stable = naming.parse_stable_local(local)
            if stable is not None:  # a stable-ABI test build: fewer archs and/or trimmed ('.sm90', '.sm90.trim...')
                found = sorted(w for w in wheels.glob(f"{name}-{public}+{stable[0]}torch{stable[1]}stable.*-{rest}")
                               if w.name != pkg.wheel)
            else:
                found = sorted(wheels.glob(f"{name}-{version}.sm*-{rest}"))
        for src in found:
            if not src.with_name(src.name + ".verify.json").is_file():
                raise AttnkitError(f"wheelhouse: {src.name} has no verification report; refusing an unverified wheel")
            return src
    hint = " (or an --archs test build, with --test-builds)" if not test_builds else ""
    raise AttnkitError(f"wheelhouse: {pkg.wheel}{hint} is not in --wheels {wheels}; build it with "
                       f"`attnkit wheels build --package {pkg.name} --cell {pkg.built_in}`, or leave it out with "
                       f"--without {pkg.name}")


def build_wheelhouse(cell: Cell, out: Path, wheels: Path | None = None, index: str | None = None, *,
                     test_builds: bool = False, without: tuple[str, ...] = ()) -> dict[str, object]:
    """Write the wheelhouse for `cell` to `out` (replaced as a whole, never half-written). `without` leaves
    packages of the cell out (recorded in the manifest: the image is then not the cell's full image)."""
    unknown = sorted(set(without) - {p.name for p in cell.packages})
    if unknown:
        raise AttnkitError(f"--without: {', '.join(unknown)} is not built for {cell.id} "
                           f"(its packages: {', '.join(p.name for p in cell.packages) or 'none'})")
    torch_req, torch_index = torch_requirement(cell)
    index = index or torch_index
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # the cell's own wheels (flash-attn, xformers): only verified ones, from the wheel pipeline
        picked = []
        kept = [p for p in cell.packages if p.name not in without]
        for pkg in kept:
            src = cell_wheel(pkg, wheels, test_builds)
            shutil.copyfile(src, stage / src.name)
            picked.append(src.name)
        # attnkit from its checkout; its dependencies come with the closure below, from its own metadata
        with tempfile.TemporaryDirectory() as tmp:
            _pip(["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, str(source_tree())],
                 "building attnkit's wheel")
            (own,) = Path(tmp).glob("attnkit-*.whl")
            shutil.copyfile(own, stage / own.name)
        own_version = parse_wheel_filename(own.name)[1]
        reqs = [torch_req, f"nox=={NOX_VERSION}", f"attnkit=={own_version}", "numpy"]
        reqs += [f"{p.name}=={p.version}" for p in kept]  # their dependencies (einops, ...)
        reqs += [r for pp in cell.pypi_packages for r in pp.requirements]  # FlashAttention-4: pinned, from PyPI
        _pip(["download", "-q", "--dest", str(stage), "--extra-index-url", index, "--find-links", str(stage),
              *_platform_args(cell), *reqs], f"downloading the closure of {', '.join(reqs[:3])}, ...")
        if cell.cuda is not None:
            _pip(["download", "-q", "--no-deps", "--dest", str(stage), *_platform_args(cell),
                  f"nvidia-cudnn-frontend=={CUDNN_FRONTEND_VERSION}"], "downloading nvidia-cudnn-frontend")
        # pip, run from its wheel by the Dockerfile: kept apart so it is not installed
        (stage / "pip").mkdir()
        _pip(["download", "-q", "--no-deps", "--dest", str(stage / "pip"), *_platform_args(cell),
              f"pip=={PIP_VERSION}"], "downloading pip")
        pip_whl = next((stage / "pip").glob("pip-*.whl"))
        pip_whl.rename(stage / "pip" / "pip.whl")
        (stage / "devel").mkdir()
        _pip(["download", "-q", "--dest", str(stage / "devel"), *_platform_args(cell), f"pip=={PIP_VERSION}",
              *DEVEL_TOOLS], "downloading the devel tools")
        (stage / "requirements.txt").write_text(requirements_for(stage))
        (stage / "devel" / "requirements.txt").write_text(requirements_for(stage / "devel"))
        manifest = {"cell": cell.id, "torch": torch_req, "torch_index": index, "cell_wheels": picked,
                    "test_builds": [w for w in picked if w not in {p.wheel for p in kept}], "left_out": list(without),
                    "pypi_packages": [r for pp in cell.pypi_packages for r in pp.requirements],
                    "files": sorted(p.name for p in stage.glob("*.whl")),
                    "bytes": sum(p.stat().st_size for p in stage.rglob("*.whl"))}
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        stage.replace(out)
        return manifest
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
