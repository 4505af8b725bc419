"""Test wheels written by hand, the way a build backend writes them: a demo project, its verification report
(what `attnkit index build` requires), and a stand-in `torch` distribution that answers attnkit's probe."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

from attnkit.wheels import accept


def _record(files: dict[str, bytes], info: str) -> bytes:
    lines = []
    for n, data in files.items():
        d = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{n},sha256={d},{len(data)}")
    lines.append(f"{info}/RECORD,,")
    return ("\n".join(lines) + "\n").encode()


def make_wheel(path: Path, name: str = "demo_pkg", version: str = "1.0", tag: str = "cp311-cp311-linux_x86_64",
               requires: tuple[str, ...] = ("torch", "numpy"), requires_python: str = ">=3.10",
               extra: dict[str, bytes] | None = None, description: str = "", module: bytes = b"VALUE = 42\n") -> Path:
    """A minimal, valid wheel (a package + dist-info; `extra` may add `<name>-<version>.data/...` files)."""
    info = f"{name}-{version}.dist-info"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\nRequires-Python: {}\n{}".format(
        name.replace("_", "-"), version, requires_python, "".join(f"Requires-Dist: {r}\n" for r in requires))
    meta += f"\n{description}" if description else ""
    top = name.split("_", 1)[0] if name == "torch" else name
    files = {f"{top}/__init__.py": module, f"{info}/METADATA": meta.encode(),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
             **(extra or {})}
    files[f"{info}/RECORD"] = _record(files, info)
    whl = path / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
    return whl


def verified(whl: Path, cell: str = "torch2.11-cu130-py311") -> Path:
    """The report `attnkit wheels verify` leaves beside a wheel it accepted (index build requires one)."""
    rep = {"ok": True, "cell": cell, "sha256": hashlib.sha256(whl.read_bytes()).hexdigest(), "problems": []}
    accept.verification_path(whl).write_text(json.dumps(rep))
    return whl


def fake_torch(path: Path, version: str, cuda: str | None, cxx11_abi: bool = True, module_version: str | None = None
               ) -> Path:
    """A `torch` distribution of that version that answers what attnkit reads of torch (version, CUDA, ABI):
    enough for pip and uv to see torch as installed, and for `attnkit index key` to compute the key.
    `module_version`: torch.__version__ where it differs from the distribution's (PyPI's CUDA 13 torch is
    distribution 2.11.0 and says 2.11.0+cu130)."""
    module = (f"__version__ = {module_version or version!r}\n"
              f"class version:\n    cuda = {cuda!r}\n"
              f"class _C:\n    _GLIBCXX_USE_CXX11_ABI = {cxx11_abi!r}\n").encode()
    return make_wheel(path, "torch", version, "py3-none-any", requires=(), requires_python=">=3.9", module=module)
