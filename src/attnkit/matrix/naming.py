"""THE one place where names are computed: cell ids, bake targets, image tags, wheel local versions and
wheel file names. Everything else calls these functions; nothing formats a name by hand.

Wheel names follow upstream flash-attn's release naming
(`flash_attn-{ver}+cu{CUDA major}torch{X.Y}cxx11abi{TRUE|FALSE}-cp{XY}-cp{XY}-linux_{machine}.whl`,
see its setup.py `get_wheel_url`) so people and tools that know upstream's scheme find ours.

A stable-ABI package (matrix.yaml `abi: stable`: built against torch's stable C ABI with TORCH_TARGET_VERSION
and as a CPython limited-API extension) is one wheel per CUDA major and arch set that serves every torch from
its minimum on and every Python from its minimum on. Its name says exactly that, the way upstream tags such
wheels (flash-attention's hopper/setup.py: py_limited_api, `cp39-abi3`):
`flash_attn_3-{ver}+cu{major}torch{min}stable.sm80sm90-cp39-abi3-linux_{machine}.whl`. The local label
names the CUDA major, the torch floor (stable ABI: `torch>=min`) and the GPU archs inside.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

_PLATFORM_MACHINE = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
MACHINES = tuple(_PLATFORM_MACHINE.values())


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
    m = re.fullmatch(r"(cu[0-9]+)torch([0-9]+\.[0-9]+)cxx11abi(true|false)", local, flags=re.IGNORECASE)
    return (m.group(1).lower(), m.group(2), m.group(3).upper() == "TRUE") if m else None


_STABLE_LOCAL = re.compile(r"(cu[0-9]+)torch([0-9]+\.[0-9]+)stable\.((?:sm[0-9]+(?:ptx)?)+)", flags=re.IGNORECASE)


def arch_token(arch: str | int) -> str:
    """'9.0', '9.0+PTX', '90' or 90 -> 'sm90' ('sm90ptx' with PTX): one arch as a stable wheel's name lists it."""
    text = str(arch)
    m = re.fullmatch(r"(\d+)\.(\d+)(\+PTX)?", text)
    if m:
        return f"sm{int(m.group(1)) * 10 + int(m.group(2))}" + ("ptx" if m.group(3) else "")
    if re.fullmatch(r"\d{2,3}", text):
        return f"sm{text}"
    raise ValueError(f"arch {text!r}: expected '9.0', '9.0+PTX' or '90'")


def options_marker(options: tuple[tuple[str, str], ...]) -> str | None:
    """'trim1a2b3c4d' for a build with recipe options set (FLASH_ATTENTION_DISABLE_FP8=TRUE, ...): a test build
    for fewer cases gets its own name, so it never passes for the full wheel; None without options."""
    if not options:
        return None
    import hashlib

    text = "\n".join(f"{k}={v}" for k, v in sorted(options))
    return "trim" + hashlib.sha256(text.encode()).hexdigest()[:8]


def stable_local_version(cuda: str, min_torch: str, archs: list[str] | tuple[str, ...],
                         trim: str | None = None) -> str:
    """'cu13torch2.9stable.sm80sm90': a stable-ABI build for CUDA 13.x, torch >= 2.9, GPU code for sm_80 and
    sm_90. Never an index key itself (parse_local_version does not read it): the index lists the wheel under
    every key it serves (stable_serves)."""
    if not archs:
        raise ValueError("a stable-ABI wheel names its archs; none given")
    base = f"{cuda_label(cuda)}torch{min_torch}stable.{''.join(arch_token(a) for a in archs)}"
    return f"{base}.{trim}" if trim else base


def parse_stable_local(local: str) -> tuple[str, str, tuple[str, ...]] | None:
    """Inverse of stable_local_version: 'cu13torch2.9stable.sm80sm90' -> ('cu13', '2.9', ('sm80', 'sm90'))."""
    m = _STABLE_LOCAL.fullmatch(local)
    if not m:
        return None
    return m.group(1).lower(), m.group(2), tuple(re.findall(r"sm[0-9]+(?:ptx)?", m.group(3).lower()))


_TEST_BUILD = re.compile(r"(?P<base>.+?)(?P<archs>\.(?:sm[0-9]+(?:ptx)?)+)?(?P<trim>\.trim[0-9a-f]{8})?")


def untrimmed(local: str) -> str:
    """The label without options_marker's '.trim<hash>' (a trimmed test build's mark)."""
    return re.sub(r"\.trim[0-9a-f]{8}\Z", "", local)


def is_pipeline_label(local: str) -> bool:
    """Whether `local` is, character for character, a label this module writes: a cell's (wheel_local_version,
    with its test-build arch subset) or a stable-ABI build's (stable_local_version), either with options_marker's
    trim. Only those become index keys: any other label a file name carries (another case, leading zeros, a
    suffix of its own) would make an index nobody asked for, or two for one cell."""
    m = _TEST_BUILD.fullmatch(local)
    if m is None:
        return False
    cell = parse_local_version(m["base"])
    if cell is not None:
        cuda, torch, abi = cell
        return m["base"] == f"cu{int(cuda[2:])}torch{_canonical_minor(torch)}cxx11abi{str(abi).upper()}"
    stable = parse_stable_local(untrimmed(local))
    if stable is None:
        return False
    cuda, floor, archs = stable
    return untrimmed(local) == f"cu{int(cuda[2:])}torch{_canonical_minor(floor)}stable.{''.join(archs)}"


def _canonical_minor(version: str) -> str:
    major, minor = version.split(".")
    return f"{int(major)}.{int(minor)}"


def stable_serves(local: str, key: str) -> bool:
    """Whether the stable-ABI wheel labelled `local` serves the environment key `key`: same CUDA major and the
    key's torch at or above the wheel's floor (any C++ ABI: the stable ABI is C)."""
    st, k = parse_stable_local(local), parse_local_version(key)
    if st is None or k is None:
        return False
    return st[0] == k[0] and _minor_key(k[1]) >= _minor_key(st[1])


def _minor_key(minor: str) -> tuple[int, int]:
    major, _, rest = minor.partition(".")
    return int(major), int(rest)


def wheel_tags(wheel_tag: str, python: str, min_python: str | None = None) -> tuple[str, str]:
    """(python tag, abi tag) for a package's tag style. 'abi3': CPython's limited API from `min_python` on
    ('cp39', 'abi3'), one wheel for every later CPython."""
    if wheel_tag == "abi3":
        if min_python is None:
            raise ValueError("wheel_tag 'abi3' needs min_python")
        return cpython_tag(min_python), "abi3"
    if wheel_tag == "cpython":
        return cpython_tag(python), cpython_tag(python)
    if wheel_tag == "py39-none":
        return "py39", "none"
    raise ValueError(f"unknown wheel_tag {wheel_tag!r}")


def dist_name(package: str) -> str:
    """Wheel file names use the normalised project name with '_' (flash-attn -> flash_attn)."""
    return canonicalize_name(package).replace("-", "_")


def platform_machine(platform: str) -> str:
    """'linux/arm64' (Docker's platform name) -> 'aarch64' (the machine wheel tags and `uname -m` name)."""
    return _PLATFORM_MACHINE[platform]


def host_platform() -> str:
    """This machine's platform ('linux/amd64' on x86_64): what a build here is for unless told otherwise."""
    import platform

    return machine_platform(platform.machine())


def machine_platform(machine: str) -> str:
    """'aarch64' (or 'arm64', as macOS and Docker spell it) -> 'linux/arm64'; the inverse of platform_machine."""
    machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)
    for platform, m in _PLATFORM_MACHINE.items():
        if m == machine:
            return platform
    from attnkit.errors import AttnkitError

    raise AttnkitError(f"machine {machine!r}: attnkit publishes for {', '.join(MACHINES)} only")


def wheel_filename(package: str, version: str, *, cuda: str, torch: str, cxx11_abi: bool,
                   python: str, wheel_tag: str, machine: str = "x86_64", arch_subset: str | None = None,
                   trim: str | None = None) -> str:
    py, abi = wheel_tags(wheel_tag, python)
    local = wheel_local_version(cuda, torch, cxx11_abi, arch_subset) + (f".{trim}" if trim else "")
    return f"{dist_name(package)}-{version}+{local}-{py}-{abi}-linux_{machine}.whl"


def stable_wheel_filename(package: str, version: str, *, cuda: str, min_torch: str, min_python: str,
                          archs: list[str] | tuple[str, ...], machine: str = "x86_64", trim: str | None = None) -> str:
    """'flash_attn_3-3.0.0+cu13torch2.9stable.sm80sm90-cp39-abi3-linux_x86_64.whl' (see the module's note); a
    trimmed test build ends its label with options_marker's '.trim1a2b3c4d', which no index key serves."""
    py, abi = wheel_tags("abi3", "", min_python)
    local = stable_local_version(cuda, min_torch, archs, trim)
    return f"{dist_name(package)}-{version}+{local}-{py}-{abi}-linux_{machine}.whl"
