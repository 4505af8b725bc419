"""The CUDA toolkit a build compiles with: an existing one (CUDA_HOME, /usr/local/cuda, nvcc on PATH), or
one provisioned from PyPI's NVIDIA toolkit wheels pinned to the cell's CUDA, so the same recipe runs in a
manylinux container, on a bare CI runner and on a workstation."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from attnkit._progress import run_streamed
from attnkit.errors import AttnkitError

# PyPI toolkit wheels (CUDA 13 names; CUDA 12 ones carry a -cu12 suffix). Together they hold nvcc, its
# front end (crt, nvvm), the runtime headers and library, and the C++ core libraries (cccl).
_PYPI_PARTS = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-nvvm")
_PYPI_PARTS_12 = ("nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12")
_PIP_STEP = re.compile(r"^\s*(Collecting|Downloading|Installing|Successfully)")


@dataclass(frozen=True)
class Toolkit:
    home: Path
    version: str  # "13.0"
    source: str  # where it came from, for logs and errors

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc"

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def nvcc_version(nvcc: Path) -> str:
    """'13.0' from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise AttnkitError(f"toolkit: cannot run {nvcc} --version ({exc})") from None
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        raise AttnkitError(f"toolkit: {nvcc} --version printed no 'release X.Y'")
    return m.group(1)


def _at(home: Path, source: str) -> Toolkit:
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise AttnkitError(f"toolkit: {source} {home} has no bin/nvcc")
    return Toolkit(home, nvcc_version(nvcc), source)


def find_existing() -> Toolkit:
    """$CUDA_HOME, then /usr/local/cuda, then the nvcc on PATH."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        return _at(Path(env), "CUDA_HOME")
    if Path("/usr/local/cuda/bin/nvcc").is_file():
        return _at(Path("/usr/local/cuda"), "/usr/local/cuda")
    which = shutil.which("nvcc")
    if which:
        return _at(Path(which).resolve().parent.parent, "nvcc on PATH")
    raise AttnkitError("toolkit: no CUDA toolkit found (CUDA_HOME unset, no /usr/local/cuda, no nvcc on PATH); "
                       "pass --toolkit pypi to provision one from PyPI, or --toolkit PATH")


def _merge_tree(src: Path, dst: Path) -> None:
    """Symlink src's files into dst, merging folders that several wheels share (include/, lib/)."""
    for entry in src.iterdir():
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink():
            if target.is_symlink():
                raise AttnkitError(f"toolkit: {target} is both a file and a folder across the toolkit wheels")
            target.mkdir(parents=True, exist_ok=True)
            _merge_tree(entry, target)
        elif not target.exists():
            target.symlink_to(entry)


def provision_pypi(cuda: str, spec: str, cache: Path, python: str = sys.executable) -> Toolkit:
    """Install the toolkit wheels for `spec` (e.g. '13.0.*') into `cache` and lay out a CUDA_HOME there.

    torch's extension builder links with -L$CUDA_HOME/lib64 -lcudart; the wheels ship lib/ and only
    libcudart.so.N, so lib64 and the unversioned name are added as links.
    """
    major = cuda.split(".")[0]
    home = cache / f"cuda-{cuda}"
    site = cache / f"cuda-{cuda}-site"
    marker = home / ".attnkit-toolkit"
    if not marker.is_file():
        parts = _PYPI_PARTS if int(major) >= 13 else _PYPI_PARTS_12
        if site.exists():
            shutil.rmtree(site)
        cmd = [python, "-m", "pip", "install", "--progress-bar", "off", "--no-deps", "--target", str(site),
               *[f"{p}=={spec}" for p in parts]]
        rc, output = run_streamed(cmd, f"CUDA {spec} toolkit wheels", _PIP_STEP)
        if rc != 0:
            errors = [ln for ln in output.strip().splitlines() if ln.startswith("ERROR")]
            last = (errors or output.strip().splitlines() or ["pip failed"])[-1]
            raise AttnkitError(f"toolkit: pip could not install the CUDA {spec} toolkit wheels: {last}")
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True)
        for top in sorted((site / "nvidia").iterdir()):
            if top.is_dir() and not top.name.startswith("__"):
                _merge_tree(top, home)
        lib = home / "lib"
        if lib.is_dir() and not (home / "lib64").exists():
            (home / "lib64").symlink_to("lib")
        for versioned in sorted(lib.glob("libcudart.so.*")) if lib.is_dir() else []:
            plain = lib / "libcudart.so"
            if not plain.exists():
                plain.symlink_to(versioned.name)
        if not (home / "bin" / "nvcc").is_file():
            raise AttnkitError(f"toolkit: the CUDA {spec} wheels did not provide bin/nvcc under {home}")
        (home / "bin" / "nvcc").chmod(0o755)
        marker.write_text(spec + "\n")
    return _at(home, f"PyPI toolkit wheels {spec}")


def resolve_toolkit(choice: str, cuda: str, pypi_spec: str | None, cache: Path, python: str) -> Toolkit:
    """`choice`: 'auto' (existing), 'pypi' (provision), or a path to a toolkit root."""
    if choice == "auto":
        return find_existing()
    if choice == "pypi":
        if pypi_spec is None:
            raise AttnkitError(f"--toolkit pypi: matrix.yaml has no toolkit_pypi for CUDA {cuda}")
        return provision_pypi(cuda, pypi_spec, cache, python)
    return _at(Path(choice), "--toolkit")


def check_major(tk: Toolkit, torch_cuda: str, where: str) -> None:
    """A CUDA extension must be compiled by the CUDA major its torch was built with."""
    if tk.major != int(torch_cuda.split(".")[0]):
        raise AttnkitError(f"toolkit: {tk.source} {tk.home} is CUDA {tk.version}, but {where} is built with CUDA "
                           f"{torch_cuda}; the CUDA majors must match (use --toolkit pypi or a {torch_cuda.split('.')[0]}.x toolkit)")


def find_tool(name: str, python: str = sys.executable) -> Path | None:
    """A CUDA binary tool (cuobjdump): CUDA_HOME, /usr/local/cuda, PATH, or the nvidia-cuda-cuobjdump wheel."""
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and (Path(base) / "bin" / name).is_file():
            return Path(base) / "bin" / name
    which = shutil.which(name)
    if which:
        return Path(which)
    r = subprocess.run([python, "-c", "import nvidia, os; print(os.pathsep.join(nvidia.__path__))"],
                       capture_output=True, text=True, check=False)
    for root in r.stdout.strip().split(os.pathsep) if r.returncode == 0 else []:
        for cand in sorted(Path(root).glob(f"*/bin/{name}")):
            return cand
    return None
