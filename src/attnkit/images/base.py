"""Base images made here, for machines that cannot pull one (no registry): a Debian root file system from
debootstrap, and for CUDA cells a stand-in for nvidia/cuda on top of it.

The stand-in carries what the nvidia/cuda base and devel images give a container and nothing of what attnkit's
images do not use from them: the NVIDIA container environment (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES,
NVIDIA_REQUIRE_CUDA, CUDA_VERSION, the /usr/local/nvidia library path the container toolkit mounts the driver
into), and for devel the cell's CUDA toolkit under /usr/local/cuda (from PyPI's NVIDIA toolkit wheels, the
same ones `attnkit wheels build --toolkit pypi` uses). It has no libcudart of its own: torch's wheels bring the
CUDA libraries, so nvidia/cuda's copy is a duplicate there anyway. nvidia/cuda stays the CI default.

Both are made per platform: a linux/arm64 base is debootstrapped for arm64, which runs its packages' scripts
through qemu-user-static's binfmt handler where this machine is x86_64, and imported as an arm64 image."""

from __future__ import annotations

import platform as _host
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from attnkit._io import cache_dir
from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.matrix.expand import Cell
from attnkit.matrix.schema import Matrix

# The Python each Debian release ships as python3.X-venv (packages.debian.org): the stand-in's Python must
# be the cell's, since the Dockerfile installs the distro's.
DEBIAN_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# Debian's and OCI's architecture names are both Docker's (amd64, arm64); nvidia/cuda's images set NVARCH to
# the CUDA repository's name for the machine (x86_64, sbsa).
_NVARCH = {"linux/amd64": "x86_64", "linux/arm64": "sbsa"}


def _arch(platform: str) -> str:
    """'linux/arm64' -> 'arm64': debootstrap's --arch and podman's --arch."""
    return platform.split("/", 1)[1]


def _ref_suffix(platform: str) -> str:
    """The amd64 images keep their names; another platform's carry it ('bookworm-arm64')."""
    return "" if platform == "linux/amd64" else f"-{_arch(platform)}"


def _foreign_ready(platform: str) -> None:
    """A foreign platform's base runs its binaries through binfmt_misc; say so in one line when it cannot."""
    if naming.platform_machine(platform) == _host.machine():
        return
    handler = Path(f"/proc/sys/fs/binfmt_misc/qemu-{naming.platform_machine(platform)}")
    if not handler.is_file() or "enabled" not in handler.read_text():
        raise AttnkitError(f"images: building for {platform} on {_host.machine()} needs qemu-user-static's binfmt "
                           f"handler ({handler} is missing: apt-get install qemu-user-static binfmt-support, and "
                           "mount binfmt_misc on /proc/sys/fs/binfmt_misc)")


def _explain(output: str) -> str:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.lower().startswith(("e:", "error", "w: failure"))]
    return (errors or lines or ["no output"])[-1][:300]


def debian_base(suite: str = "bookworm", mirror: str = DEBIAN_MIRROR, platform: str = "linux/amd64") -> str:
    """localhost/debian-base:<suite>[-arm64], made once with debootstrap + podman import (needs root)."""
    ref = f"localhost/debian-base:{suite}{_ref_suffix(platform)}"
    if subprocess.run(["podman", "image", "exists", ref], check=False).returncode == 0:
        return ref
    if not shutil.which("debootstrap"):
        raise AttnkitError("images: debootstrap is not installed (apt-get install debootstrap)")
    _foreign_ready(platform)
    with tempfile.TemporaryDirectory(prefix="attnkit-rootfs-") as tmp:
        d = subprocess.run(["debootstrap", f"--arch={_arch(platform)}", "--variant=minbase", suite, tmp, mirror],
                           capture_output=True, text=True, check=False)
        if d.returncode != 0:
            raise AttnkitError(f"images: debootstrap {suite} ({_arch(platform)}) failed: {_explain(d.stdout + d.stderr)}")
        tar = subprocess.Popen(["tar", "-C", tmp, "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(["podman", "import", "--arch", _arch(platform), "-", ref], stdin=tar.stdout,
                             capture_output=True, text=True, check=False)
        tar.wait()
        if imp.returncode != 0:
            raise AttnkitError(f"images: podman import failed: {_explain(imp.stderr)}")
    return ref


def suite_for(python: str) -> str:
    for suite, py in DEBIAN_PYTHON.items():
        if py == python:
            return suite
    have = ", ".join(f"{s}: {p}" for s, p in DEBIAN_PYTHON.items())
    raise AttnkitError(f"images: no Debian release ships Python {python} ({have}); a local base needs a cell with "
                       f"one of those Pythons, or build on nvidia/cuda (CI)")


def cuda_release(image: str) -> str:
    """'13.0.2' from 'nvidia/cuda:13.0.2-base-ubuntu24.04': the CUDA_VERSION that base image sets."""
    m = re.search(r":(\d+\.\d+\.\d+)-", image)
    if not m:
        raise AttnkitError(f"images: cannot read a CUDA release from the base image {image!r}")
    return m.group(1)


def _copy_toolkit(home: Path, dest: Path) -> None:
    """The provisioned toolkit as real files: its layout links into the wheels' site folder (absolute links),
    which the image would not have; relative links inside it (lib64 -> lib) stay links."""
    shutil.copytree(home, dest, symlinks=True)
    for link in [p for p in dest.rglob("*") if p.is_symlink() and Path(p.readlink()).is_absolute()]:
        target = link.resolve()
        link.unlink()
        if target.is_dir():
            shutil.copytree(target, link, symlinks=False)
        else:
            shutil.copy2(target, link)


def standin_containerfile(cuda: str, release: str, base: str, toolkit: bool, platform: str = "linux/amd64") -> str:
    """The stand-in for nvidia/cuda:<release>-{base|devel}: its container environment, its toolkit for devel."""
    env = {
        "NVARCH": _NVARCH[platform],
        "CUDA_VERSION": release,
        "NVIDIA_REQUIRE_CUDA": f"cuda>={cuda}",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        "PATH": "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    }
    lines = [f"FROM {base}",
             f'LABEL org.attnkit.standin-for="nvidia/cuda:{release}-{"devel" if toolkit else "base"}"',
             "ENV " + " ".join(f'{k}="{v}"' for k, v in env.items()),
             "RUN printf '/usr/local/nvidia/lib\\n/usr/local/nvidia/lib64\\n' > /etc/ld.so.conf.d/nvidia.conf"]
    if toolkit:
        lines.append("COPY cuda/ /usr/local/cuda/")
    return "\n".join(lines) + "\n"


def cuda_standin(m: Matrix, cell: Cell, variant: str, platform: str = "linux/amd64") -> str:
    """localhost/attnkit-cuda-standin:<cuda>-<variant>-<suite>[-arm64], built once (needs root for the Debian
    base)."""
    from attnkit.wheels.toolkit import provision_pypi

    assert cell.cuda is not None
    suite = suite_for(cell.python)
    release = cuda_release(getattr(m.cuda[cell.cuda].images, variant).image)
    ref = f"localhost/attnkit-cuda-standin:{cell.cuda}-{variant}-{suite}{_ref_suffix(platform)}"
    if subprocess.run(["podman", "image", "exists", ref], check=False).returncode == 0:
        return ref
    if variant == "devel" and platform != naming.host_platform():
        raise AttnkitError(f"images: a devel stand-in for {platform} is not made here (its toolkit comes from "
                           "PyPI's wheels for this machine); use nvidia/cuda's devel image")
    base = debian_base(suite, platform=platform)
    with tempfile.TemporaryDirectory(prefix="attnkit-standin-") as tmp:
        ctx = Path(tmp)
        if variant == "devel":
            spec = m.cuda[cell.cuda].toolkit_pypi
            tk = provision_pypi(cell.cuda, spec, cache_dir() / "toolkits")
            _copy_toolkit(tk.home, ctx / "cuda")
        (ctx / "Containerfile").write_text(standin_containerfile(cell.cuda, release, base, variant == "devel",
                                                                 platform))
        r = subprocess.run(["podman", "build", "--isolation", "chroot", "--platform", platform, "-t", ref, "-f",
                            str(ctx / "Containerfile"), str(ctx)], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise AttnkitError(f"images: the CUDA stand-in base failed: {_explain(r.stdout + r.stderr)}")
    return ref


def local_base(m: Matrix, cell: Cell, variant: str, platform: str | None = None) -> str:
    """The base for `cell` on `platform` (default: this machine's) made here: Debian for the CPU cell, the
    nvidia/cuda stand-in for a CUDA cell."""
    platform = platform or naming.host_platform()
    if platform not in cell.platforms:
        raise AttnkitError(f"--platform: {cell.id} is not published for {platform} (its platforms: "
                           f"{', '.join(cell.platforms)})")
    if cell.cuda is None:
        return debian_base(suite_for(cell.python), platform=platform)
    return cuda_standin(m, cell, variant, platform)
