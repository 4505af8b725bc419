"""Facts about a Python environment that decide which wheel fits it: torch version and CUDA, C++ ABI, Python
tag, platform. Read in a subprocess so the driver can target another interpreter (a cell's venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.matrix.expand import Cell

_PROBE = r"""
import importlib.util, json, os, platform, sys
out = {"python": "%d.%d" % sys.version_info[:2], "machine": platform.machine(), "executable": sys.executable,
       "has_pip": importlib.util.find_spec("pip") is not None}
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    import importlib.metadata
    out.update(torch_dist=importlib.metadata.version("torch"))
except Exception as exc:
    out.update(torch=None, torch_error="%s: %s" % (type(exc).__name__, exc))
if importlib.util.find_spec("packaging") is None:  # load attnkit's `packaging` alone, nothing else of its env
    pkg = os.path.join(sys.argv[1], "packaging")
    spec = importlib.util.spec_from_file_location("packaging", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    sys.modules["packaging"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["packaging"])
from packaging import tags
out["tags"] = [str(t) for t in tags.sys_tags()]
print(json.dumps(out))
"""


@dataclass(frozen=True)
class PyEnv:
    executable: str
    python: str  # "3.12"
    machine: str  # "x86_64"
    torch: str | None  # "2.11.0+cu130"
    torch_cuda: str | None  # "13.0"
    cxx11_abi: bool | None
    tags: tuple[str, ...] = ()  # packaging.tags.sys_tags() of that interpreter, most preferred first
    has_pip: bool = True
    torch_dist: str | None = None  # the installed distribution's version: PyPI's cu130 torch says "2.11.0"
    #                                 there and "2.11.0+cu130" in torch.__version__
    torch_error: str | None = None  # `import torch` failed there: "ExceptionType: message"

    @property
    def torch_minor(self) -> str | None:
        if self.torch is None:
            return None
        major, minor = self.torch.split("+")[0].split(".")[:2]
        return f"{major}.{minor}"

    def index_key(self) -> str:
        """The key of the wheel index that fits this environment (naming.index_key of its torch)."""
        if self.torch is None or self.torch_minor is None:
            if self.torch_error and "No module named 'torch'" not in self.torch_error:
                from attnkit.errors import torch_import_failure

                raise AttnkitError(f"{self.executable}: {torch_import_failure(self.torch_error)}")
            raise AttnkitError(f"{self.executable}: torch is not installed; install your cell's torch first")
        if not self.torch_cuda:
            raise AttnkitError(f"{self.executable}: torch {self.torch} is a CPU build; attnkit's wheels need CUDA "
                               f"torch")
        return naming.index_key(self.torch_cuda, self.torch_minor, bool(self.cxx11_abi))


def describe(python: str = sys.executable) -> PyEnv:
    """Ask the interpreter itself: its wheel tags come from packaging.tags evaluated THERE (manylinux glibc,
    abi3, py3-none all as pip would see them), not from what attnkit's own interpreter is."""
    import packaging

    ours = str(Path(packaging.__file__).resolve().parents[1])
    try:
        r = subprocess.run([python, "-c", _PROBE, ours], capture_output=True, text=True, check=True, timeout=300)
        d = json.loads(r.stdout.strip().splitlines()[-1])
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr.strip().splitlines() or ["?"])[-1]
        raise AttnkitError(f"--python {python}: cannot run it to read its torch ({last})") from None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise AttnkitError(f"--python {python}: cannot run it to read its torch ({exc})") from None
    return PyEnv(d["executable"], d["python"], d["machine"], d.get("torch"), d.get("torch_cuda"), d.get("cxx11_abi"),
                 tuple(d["tags"]), bool(d["has_pip"]), d.get("torch_dist"), d.get("torch_error"))


def cell_mismatches(env: PyEnv, cell: Cell) -> list[str]:
    """How `env` differs from what `cell` needs; [] when it matches."""
    out = []
    if env.torch is None:
        return [f"no torch in {env.executable} (the cell needs torch {cell.torch_version})"]
    if env.torch_minor != cell.torch:
        out.append(f"torch {env.torch} is not {cell.torch}.x")
    if cell.cuda is not None and (env.torch_cuda or "").split(".")[0] != cell.cuda.split(".")[0]:
        out.append(f"torch is built with CUDA {env.torch_cuda or 'none (CPU build)'}, the cell with CUDA {cell.cuda}")
    if env.python != cell.python:
        out.append(f"Python {env.python} is not {cell.python}")
    if env.cxx11_abi is not None and env.cxx11_abi != cell.cxx11_abi:
        out.append(f"torch C++11 ABI is {env.cxx11_abi}, the cell's is {cell.cxx11_abi}")
    return out


TORCH_INDEX = "https://download.pytorch.org/whl/{label}"  # PyTorch's own wheels: cpu, cu126, cu130, ...
ENV_TORCH_INDEX = "ATTNKIT_TORCH_INDEX"  # a mirror of it (air-gapped CI, a local proxy)


def torch_requirement(cell: Cell) -> tuple[str, str]:
    """(requirement, index URL) of the cell's torch build: PyPI's plain `torch` is one CUDA flavour only,
    so every cell installs from PyTorch's per-CUDA index (or the mirror ATTNKIT_TORCH_INDEX names)."""
    label = naming.accelerator_label(cell.cuda)
    version = cell.torch_version + ("+cpu" if cell.cuda is None else "")
    index = os.environ.get(ENV_TORCH_INDEX) or TORCH_INDEX.format(label=label)
    return f"torch=={version}", index
