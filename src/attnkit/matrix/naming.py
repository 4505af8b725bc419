"""THE one place where names are computed: cell ids, bake targets, image tags, wheel local versions and
wheel file names. Everything else calls these functions; nothing formats a name by hand.

Wheel names follow upstream flash-attn's release naming
(`flash_attn-{ver}+cu{CUDA major}torch{X.Y}cxx11abi{TRUE|FALSE}-cp{XY}-cp{XY}-linux_{machine}.whl`,
see its setup.py `get_wheel_url`) so people and tools that know upstream's scheme find ours.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

_PLATFORM_MACHINE = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}


def _nodot(version: str) -> str:
    return version.replace(".", "")


def accelerator_label(cuda: str | None) -> str:
    """PyTorch's label for a build: 'cu130' for CUDA 13.0, 'cpu'. Its index is download.pytorch.org/whl/<label>."""
    return f"cu{_nodot(cuda)}" if cuda else "cpu"


def cpython_tag(python: str) -> str:
    """'3.12' -> 'cp312' (the interpreter and ABI tag of CPython wheels)."""
    return f"cp{_nodot(python)}"


def cell_id(torch: str, cuda: str | None, python: str) -> str:
    """'torch2.11-cu130-py312' (or 'torch2.13-cpu-py311'): stable, readable, usable as an image tag."""
    return f"torch{torch}-{accelerator_label(cuda)}-py{_nodot(python)}"


def bake_target(cid: str, variant: str) -> str:
    """Bake target names allow only [A-Za-z0-9_-]."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{cid}-{variant}")


def image_repo(registry: str, image: str) -> str:
    return f"{registry.rstrip('/')}/{image}"


def image_tag(registry: str, image: str, cid: str, variant: str) -> str:
    """The immutable per-cell tag: ghcr.io/attnkit/attnkit:torch2.11-cu130-py312-runtime."""
    return f"{image_repo(registry, image)}:{cid}-{variant}"


def moving_tags(registry: str, image: str, torch: str, cuda: str | None, variant: str,
                newest_python: bool, reference: bool) -> list[str]:
    """Tags that move to a new build only after it passes the GPU smoke test.

    The newest-Python cell of a (torch, cuda) pair owns 'torch2.11-cu130'; the reference cell owns 'latest'.
    The devel variant gets the same names with a '-devel' suffix.
    """
    suffix = "" if variant == "runtime" else f"-{variant}"
    repo = image_repo(registry, image)
    tags: list[str] = []
    if newest_python:
        tags.append(f"{repo}:torch{torch}-{accelerator_label(cuda)}{suffix}")
    if reference:
        tags.append(f"{repo}:latest{suffix}")
    return tags


def cuda_label(cuda: str) -> str:
    """Upstream flash-attn labels wheels by CUDA major only: torch cu126/cu128 -> 'cu12', cu130 -> 'cu13'."""
    return f"cu{cuda.split('.')[0]}"


def wheel_local_version(cuda: str, torch: str, cxx11_abi: bool, arch_subset: str | None = None) -> str:
    """'cu13torch2.11cxx11abiTRUE': what differs between builds of one release. A build restricted to fewer
    archs than its cell's (a test build, `--archs`) is marked '.sm90', so it can never pass for the cell's
    wheel: resolve() does not pick it and its name differs."""
    base = f"{cuda_label(cuda)}torch{torch}cxx11abi{str(cxx11_abi).upper()}"
    return f"{base}.{arch_subset}" if arch_subset else base


def index_key(cuda: str, torch: str, cxx11_abi: bool) -> str:
    """The environment key of the wheel index: one pip index per key (SITE/<key>/simple), the way PyTorch
    serves one per CUDA. It is the wheels' local version label, so one index never holds two builds that
    pip would have to order by that label (PEP 440 compares local labels segment by segment as text, so
    'torch2.9' > 'torch2.14' > 'torch2.11': a flat index over all cells picks the wrong wheel)."""
    return wheel_local_version(cuda, torch, cxx11_abi)


def simple_index_url(site: str, key: str) -> str:
    """<site>/<key>/simple/: what `pip install --index-url` and `uv pip install --index` take."""
    return f"{site.rstrip('/')}/{key}/simple/"


def parse_local_version(local: str) -> tuple[str, str, bool] | None:
    """Inverse of wheel_local_version: 'cu13torch2.11cxx11abiTRUE' -> ('cu13', '2.11', True).
    Case-insensitive: PEP 440 normalisation lower-cases local versions ('cxx11abitrue')."""
    m = re.fullmatch(r"(cu\d+)torch(\d+\.\d+)cxx11abi(true|false)", local, flags=re.IGNORECASE)
    return (m.group(1).lower(), m.group(2), m.group(3).upper() == "TRUE") if m else None


def wheel_tags(wheel_tag: str, python: str) -> tuple[str, str]:
    """(python tag, abi tag) for a package's tag style."""
    if wheel_tag == "cpython":
        return cpython_tag(python), cpython_tag(python)
    if wheel_tag == "py39-none":
        return "py39", "none"
    raise ValueError(f"unknown wheel_tag {wheel_tag!r}")


def dist_name(package: str) -> str:
    """Wheel file names use the normalised project name with '_' (flash-attn -> flash_attn)."""
    return canonicalize_name(package).replace("-", "_")


def platform_machine(platform: str) -> str:
    return _PLATFORM_MACHINE[platform]


def wheel_filename(package: str, version: str, *, cuda: str, torch: str, cxx11_abi: bool,
                   python: str, wheel_tag: str, machine: str = "x86_64", arch_subset: str | None = None) -> str:
    py, abi = wheel_tags(wheel_tag, python)
    local = wheel_local_version(cuda, torch, cxx11_abi, arch_subset)
    return f"{dist_name(package)}-{version}+{local}-{py}-{abi}-linux_{machine}.whl"
