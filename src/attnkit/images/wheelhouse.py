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
import platform
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


def _platform_args(cell: Cell, machine: str) -> list[str]:
    """pip download's view of the image on one machine: every manylinux tag its glibc runs (NCCL's wheels are
    2_18, torch's 2_28, others 2_17 or 2_34), for the cell's CPython."""
    plats = [f"manylinux_{BASE_GLIBC[0]}_{m}_{machine}" for m in range(BASE_GLIBC[1], 16, -1)]
    plats += [f"manylinux2014_{machine}", f"linux_{machine}"]
    return ["--only-binary=:all:", "--python-version", cell.python, "--implementation", "cp",
            "--abi", naming.cpython_tag(cell.python), *[x for p in plats for x in ("--platform", p)]]


def wheelhouse_platforms(cell: Cell, asked: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The platforms a wheelhouse serves: those asked for ('all': every one of the cell's), else this
    machine's. A multi-platform image (buildx bake `platforms`) needs every one of its platforms' wheels."""
    if "all" in asked:
        return cell.platforms
    want = asked or (naming.host_platform(),)
    missing = [p for p in want if p not in cell.platforms]
    if missing:
        raise AttnkitError(f"--platform: {cell.id} is not published for {', '.join(missing)} (its platforms: "
                           f"{', '.join(cell.platforms)}, or all)")
    return tuple(dict.fromkeys(want))


def _pip(args: list[str], what: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise AttnkitError(f"wheelhouse: {what} failed: {_pip_reason(r.stderr)}")


def _pip_reason(stderr: str) -> str:
    """pip's most telling line: what it could not install, rather than its closing pointer to the docs."""
    lines = stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["?"]
    return next((ln for ln in errors if "Could not find" in ln or "Cannot install" in ln), errors[-1])[:300]


def _machine_markers(folder: Path, machine: str) -> list[str]:
    """The wheels in `folder` that install on `machine` and whose Requires-Dist depends on platform_machine.
    pip download --platform filters tags only and evaluates markers against THIS interpreter, so a foreign
    machine's closure is wrong exactly when such a requirement is in it."""
    import zipfile

    found = []
    for whl in sorted(folder.glob("*.whl")):
        if not _machines(whl) & {machine, "any"}:
            continue
        with zipfile.ZipFile(whl) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode("utf-8", "replace") if meta else ""
        if any(ln.startswith("Requires-Dist:") and "platform_machine" in ln for ln in text.splitlines()):
            found.append(whl.name)
    return found


def _machines(whl: Path) -> set[str]:
    """The machines a wheel installs on: {'any'} for a pure one, else the machines its platform tags name."""
    plats = {t.platform for t in parse_wheel_filename(whl.name)[3]}
    if "any" in plats:
        return {"any"}
    return {m for m in naming.MACHINES if any(p.endswith(f"_{m}") for p in plats)}


def requirements_for(folder: Path, machines: tuple[str, ...] = ()) -> str:
    """`name==version --hash=sha256:...` per distribution in a folder, with the hash of each of its files. A
    wheelhouse for several machines holds one file per machine of a binary distribution; a distribution whose
    files do not serve every one of `machines` (one machine's closure only, or another version there) gets a
    marker, so pip installs it where it belongs and skips it elsewhere."""
    groups: dict[tuple[str, str], list[Path]] = {}
    for whl in sorted(folder.glob("*.whl")):
        dist, ver, _, _ = parse_wheel_filename(whl.name)
        groups.setdefault((str(dist), str(ver)), []).append(whl)
    lines: list[str] = []
    served_by_name: dict[str, list[set[str]]] = {}
    for (name, version), files in groups.items():
        served = set().union(*(_machines(f) for f in files))
        marker = ""
        if machines and "any" not in served and not set(machines) <= served:
            marker = " ; " + " or ".join(f'platform_machine == "{m}"' for m in sorted(served))
        for other in served_by_name.get(name, []):
            if "any" in served | other or served & other:
                raise AttnkitError(f"wheelhouse: {name} has two versions for one machine ({sorted(served | other)}); "
                                   "its closures disagree, pin it")
        served_by_name.setdefault(name, []).append(served)
        hashes = " ".join(f"--hash=sha256:{hashlib.sha256(f.read_bytes()).hexdigest()}" for f in files)
        lines.append(f"{name}=={version}{marker} {hashes}")
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
                     test_builds: bool = False, without: tuple[str, ...] = (),
                     platforms: tuple[str, ...] = ()) -> dict[str, object]:
    """Write the wheelhouse for `cell` to `out` (replaced as a whole, never half-written), for `platforms`
    (wheelhouse_platforms: this machine's unless asked). `without` leaves packages of the cell out (recorded
    in the manifest: the image is then not the cell's full image)."""
    platforms = wheelhouse_platforms(cell, platforms)
    machines = tuple(naming.platform_machine(p) for p in platforms)
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
        kept = [p for p in cell.packages if p.name not in without and p.platform in platforms]
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
        reqs += list(dict.fromkeys(f"{p.name}=={p.version}" for p in kept))  # their dependencies (einops, ...)
        reqs += [r for pp in cell.pypi_packages for r in pp.requirements]  # FlashAttention-4: pinned, from PyPI
        (stage / "pip").mkdir()
        (stage / "devel").mkdir()
        host = platform.machine()
        for machine in machines:  # each machine's closure into one folder; requirements_for marks what differs
            _pip(["download", "-q", "--dest", str(stage), "--extra-index-url", index, "--find-links", str(stage),
                  *_platform_args(cell, machine), *reqs],
                 f"downloading the closure of {', '.join(reqs[:3])}, ... for {machine} (torch from {index})")
            marked = _machine_markers(stage, machine) if machine != host else []
            if marked:
                raise AttnkitError(f"wheelhouse: {', '.join(marked[:3])} declare platform_machine markers, which pip "
                                   f"evaluates for this {host} machine, not {machine}: build the {machine} "
                                   f"wheelhouse on a {machine} machine")
            if cell.cuda is not None:
                _pip(["download", "-q", "--no-deps", "--dest", str(stage), *_platform_args(cell, machine),
                      f"nvidia-cudnn-frontend=={CUDNN_FRONTEND_VERSION}"], f"downloading nvidia-cudnn-frontend for {machine}")
            _pip(["download", "-q", "--dest", str(stage / "devel"), *_platform_args(cell, machine),
                  f"pip=={PIP_VERSION}", *DEVEL_TOOLS], f"downloading the devel tools for {machine}")
        # pip, run from its wheel by the Dockerfile (pure Python, one file for every machine): kept apart so it
        # is not installed
        _pip(["download", "-q", "--no-deps", "--dest", str(stage / "pip"), *_platform_args(cell, machines[0]),
              f"pip=={PIP_VERSION}"], "downloading pip")
        pip_whl = next((stage / "pip").glob("pip-*.whl"))
        pip_whl.rename(stage / "pip" / "pip.whl")
        (stage / "requirements.txt").write_text(requirements_for(stage, machines))
        (stage / "devel" / "requirements.txt").write_text(requirements_for(stage / "devel", machines))
        manifest = {"cell": cell.id, "platforms": list(platforms), "torch": torch_req, "torch_index": index, "cell_wheels": picked,
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
