"""The validated model of matrix.yaml.

Types carry the rules (version formats, closed key sets) so a malformed file fails at load time with
a message naming the field; facts that span fields (a CUDA named by a torch release must be described under
`cuda:`, a cell the build rules name must be one PyTorch ships) are listed by `problems()`, which the loader
runs once and reports through the same one-line error path, with the line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Literal

from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# ASCII only, and \Z (not $, which also matches before a trailing newline): a version or name read from the file
# becomes part of cell ids, image tags and file names. Bounded lengths keep packaging's int() of a segment cheap.
_MINOR_RE = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}\Z", re.ASCII)
_SM_RE = re.compile(r"[0-9]{2,3}\Z", re.ASCII)
_ARCH_RE = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}(\+PTX)?\Z", re.ASCII)
_SHA256_RE = re.compile(r"[0-9a-f]{64}\Z", re.ASCII)
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z", re.ASCII)
_RELEASE_RE = re.compile(r"[0-9A-Za-z.+!_-]{1,64}\Z", re.ASCII)
_REGISTRY_RE = re.compile(r"[a-z0-9][a-z0-9.-]*(:[0-9]{1,5})?(/[a-z0-9][a-z0-9._-]*)*\Z", re.ASCII)
_URL_RE = re.compile(r"https?://[\x21-\x7e]+\Z", re.ASCII)  # printable ASCII, no spaces or control characters


def _minor(value: str) -> str:
    if not _MINOR_RE.match(value):
        raise ValueError(f"{value!r} is not a MAJOR.MINOR version such as '12.8' (ASCII digits)")
    return value


def _release(value: str) -> str:
    if not _RELEASE_RE.match(value):
        raise ValueError(f"{value[:80]!r} is not a PEP 440 version such as '2.11.0' (ASCII, at most 64 characters)")
    try:
        Version(value)
    except (InvalidVersion, ValueError):
        raise ValueError(f"{value!r} is not a PEP 440 version such as '2.11.0'") from None
    return value


def _sm(value: str) -> str:
    if not _SM_RE.match(value):
        raise ValueError(f"{value!r} is not an SM number such as '90'")
    return value


def _arch(value: str) -> str:
    if not _ARCH_RE.match(value):
        raise ValueError(f"{value!r} is not a TORCH_CUDA_ARCH_LIST entry such as '9.0'")
    return value


def _sha256(value: str) -> str:
    if not _SHA256_RE.match(value):
        raise ValueError("must be 64 lowercase hex digits")
    return value


def _digest(value: str | None) -> str | None:
    if value is not None and not _DIGEST_RE.match(value):
        raise ValueError(f"{value!r} is not an image digest 'sha256:<64 hex>'")
    return value


def _registry(value: str) -> str:
    if not _REGISTRY_RE.match(value):
        raise ValueError(f"{value[:80]!r} is not a registry such as 'ghcr.io/attnkit' (lowercase ASCII host[:port]/path, "
                         "no spaces or newlines)")
    return value


def _url(value: str) -> str:
    if not _URL_RE.match(value):
        raise ValueError(f"{value[:80]!r} is not an http(s):// URL (printable ASCII, no spaces or newlines)")
    return value


def _schema_version(value: object) -> object:
    if type(value) is not int:  # YAML `true` and `1.0` compare equal to 1; only the integer 1 is a version
        raise ValueError(f"got {type(value).__name__} {value!r}; allowed: 1 (the integer)")
    return value


MinorVersion = Annotated[str, AfterValidator(_minor)]
ReleaseVersion = Annotated[str, AfterValidator(_release)]
SmNumber = Annotated[str, AfterValidator(_sm)]
ArchEntry = Annotated[str, AfterValidator(_arch)]
Sha256 = Annotated[str, AfterValidator(_sha256)]
Digest = Annotated[str | None, AfterValidator(_digest)]
Registry = Annotated[str, AfterValidator(_registry)]
Url = Annotated[str, AfterValidator(_url)]
Variant = Literal["runtime", "devel"]
VARIANTS: tuple[Variant, ...] = ("runtime", "devel")
# Docker's platform names (what buildx bake's `platforms` and manifests use); wheels name the machine instead
# (naming.platform_machine: linux/arm64 -> aarch64).
Platform = Literal["linux/amd64", "linux/arm64"]


def vkey(value: str) -> Version:
    """Sort/compare key for MAJOR.MINOR strings ('2.9' < '2.10')."""
    return Version(value)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PythonRange(_Strict):
    min: MinorVersion
    max: MinorVersion

    @model_validator(mode="after")
    def _ordered(self) -> PythonRange:
        if vkey(self.min) > vkey(self.max):
            raise ValueError(f"python.min {self.min} is newer than python.max {self.max}")
        return self

    def contains(self, python: str) -> bool:
        return vkey(self.min) <= vkey(python) <= vkey(self.max)


class TorchCuda(_Strict):
    stable: list[MinorVersion] = Field(min_length=1)
    experimental: list[MinorVersion] = Field(default_factory=list)


class TorchRelease(_Strict):
    version: ReleaseVersion
    python: PythonRange
    cuda: TorchCuda
    cxx11_abi: bool
    source: str
    # the machines PyTorch publishes this release's wheels for (CPU, and every CUDA above that has an arch list
    # for the machine); absent: x86_64 only, what every release has
    platforms: list[Platform] = Field(default_factory=lambda: list[Platform](["linux/amd64"]), min_length=1)

    def all_cuda(self) -> list[str]:
        return [*self.cuda.stable, *self.cuda.experimental]


class ImageRef(_Strict):
    # printable ASCII: no spaces or newlines; 255 characters at most, the OCI distribution spec's repository bound
    image: str = Field(min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$")
    digest: Digest = None

    def ref(self) -> str:
        """The reference a build should use: pinned by digest when one is recorded."""
        return f"{self.image}@{self.digest}" if self.digest else self.image


class Images(_Strict):
    runtime: ImageRef
    devel: ImageRef


class CudaToolkit(_Strict):
    torch_arch_list: list[ArchEntry] = Field(min_length=1)  # PyTorch's linux/amd64 wheels
    # PyTorch's linux/arm64 wheels, where read off one; without it no arm64 cell uses this CUDA
    torch_arch_list_arm64: list[ArchEntry] | None = Field(default=None, min_length=1)
    toolkit_pypi: str
    images: Images

    def arch_list(self, platform: str) -> list[str] | None:
        """The arch list of PyTorch's wheels of this CUDA for `platform`; None where none is known."""
        return self.torch_arch_list if platform == "linux/amd64" else self.torch_arch_list_arm64


class CpuSection(_Strict):
    images: Images


class Sdist(_Strict):
    url: Url = Field(pattern=r"^https://")
    sha256: Sha256


_COMMIT_RE = re.compile(r"[0-9a-f]{40}\Z", re.ASCII)
_REL_PATH_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}\Z", re.ASCII)


def _commit(value: str) -> str:
    if not _COMMIT_RE.match(value):
        raise ValueError(f"{value[:80]!r} is not a git commit (40 lowercase hex digits; a tag or branch can move)")
    return value


def _rel_path(value: str) -> str:
    if not _REL_PATH_RE.match(value) or ".." in value.split("/"):
        raise ValueError(f"{value[:80]!r} is not a path inside the repository (letters, digits, '._-/', no '..')")
    return value


GitCommit = Annotated[str, AfterValidator(_commit)]
RepoPath = Annotated[str, AfterValidator(_rel_path)]


class GitSubmodule(_Strict):
    url: Url = Field(pattern=r"^https://")
    commit: GitCommit  # must be the commit the superproject's tree records for this path (checked when fetched)
    paths: list[RepoPath] = Field(default_factory=list)  # what of it the build reads (empty: everything)


class GitSource(_Strict):
    """A source pinned by commit where no sdist is published (FlashAttention-3: hopper/ of flash-attention)."""

    url: Url = Field(pattern=r"^https://")
    commit: GitCommit
    subdir: RepoPath | None = None  # the folder with setup.py
    paths: list[RepoPath] = Field(default_factory=list)  # what of the tree the build reads (empty: everything)
    submodules: dict[RepoPath, GitSubmodule] = Field(default_factory=dict)


class PackageArch(_Strict):
    sm: SmNumber
    min_cuda: MinorVersion


class PackageLimits(_Strict):
    """What a build needs. What a GPU needs to run it (compute capability) and how it is imported are runtime
    facts: they live once, in the backend's Limits (runtime/backends/) and the probe's LibraryRow."""

    min_cuda: MinorVersion
    min_torch: MinorVersion


class Package(_Strict):
    version: ReleaseVersion
    extension: str
    sdist: Sdist | None = None  # the published sdist, or, where there is none,
    git: GitSource | None = None  # a commit of the repository (exactly one of the two)
    wheel_tag: Literal["cpython", "py39-none", "abi3"]
    archs: list[PackageArch] | Literal["torch"]
    limits: PackageLimits
    source: str
    # compile jobs per wheel in CI: wheels.yml runs this many shard jobs, then one link job (wheels/shards.py)
    shards: int = Field(default=1, ge=1, le=64)
    # "cell": built against one torch's C++ ABI, one wheel per torch x CUDA major (x Python for cpython tags).
    # "stable": built against torch's stable C ABI (TORCH_TARGET_VERSION = limits.min_torch) as a CPython
    # limited-API extension (wheel_tag abi3 from min_python): ONE wheel per CUDA major and arch set serves every
    # torch >= limits.min_torch and every Python >= min_python (naming.stable_wheel_filename)
    abi: Literal["cell", "stable"] = "cell"
    min_python: MinorVersion | None = None  # abi: stable only: the oldest CPython of its limited API (cp39-abi3)


class PypiPackage(_Strict):
    """An attention library used as published on PyPI: nothing to build (FlashAttention-4 is pure Python and
    compiles its kernels at first use). Its pins per CUDA major go into the images' hash-locked wheelhouse."""

    version: ReleaseVersion
    requires: dict[Literal["cu12", "cu13"], list[str]] = Field(min_length=1)  # pinned requirements, itself first
    archs: list[SmNumber] = Field(min_length=1)  # the GPU archs it has kernels for
    max_python: MinorVersion  # the newest Python every pinned wheel is published for
    limits: PackageLimits
    source: str


class Publish(_Strict):
    registry: Registry
    image: str = Field(pattern=r"^[a-z0-9][a-z0-9._/-]*$")
    wheel_site: Url  # the site root; each key's index is <site>/<key>/simple
    platforms: list[Platform] = Field(min_length=1)  # what we publish; a cell gets those its torch and CUDA have


class CellSpec(_Strict):
    """A partial cell: missing keys match anything (used by include/exclude rules)."""

    torch: MinorVersion | None = None
    cuda: MinorVersion | None = None
    python: MinorVersion | None = None


class CpuCellSpec(_Strict):
    torch: MinorVersion
    python: MinorVersion


class BuildRules(_Strict):
    python: list[MinorVersion] = Field(min_length=1)
    include: list[CellSpec] = Field(default_factory=list)
    exclude: list[CellSpec] = Field(default_factory=list)
    cpu: list[CpuCellSpec] = Field(default_factory=list)


class ReferenceCell(_Strict):
    torch: MinorVersion
    cuda: MinorVersion
    python: MinorVersion


class Matrix(_Strict):
    schema_version: Annotated[Literal[1], BeforeValidator(_schema_version)]
    torch: dict[MinorVersion, TorchRelease] = Field(min_length=1)
    cuda: dict[MinorVersion, CudaToolkit] = Field(min_length=1)
    cpu: CpuSection
    packages: dict[Literal["flash-attn", "xformers", "flash-attn-3"], Package]
    pypi_packages: dict[Literal["flash-attn-4"], PypiPackage] = Field(default_factory=dict)
    publish: Publish
    build: BuildRules
    reference_cell: ReferenceCell


Problem = tuple[tuple[str | int, ...], str]


def _exact_pin(req: str) -> tuple[str, str] | None:
    """('flash-attn-4', '4.0.0b36') for 'flash-attn-4[cu13]==4.0.0b36'; None unless pinned with ==."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    try:
        r = Requirement(req)
    except InvalidRequirement:
        return None
    specs = list(r.specifier)
    if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
        return None
    return str(canonicalize_name(r.name)), specs[0].version


def combination_reasons(m: Matrix, torch: str | None, cuda: str | None, python: str | None) -> list[str]:
    """Why (torch, cuda, python) cannot exist, per PyTorch's release table; [] when it can.

    `cuda` is "X.Y", "cpu" or None (any); missing parts match anything.
    """
    reasons: list[str] = []
    if torch is not None and torch not in m.torch:
        known = ", ".join(sorted(m.torch, key=vkey))
        return [f"torch {torch} is not in the matrix (known: {known})"]
    if cuda not in (None, "cpu") and cuda not in m.cuda:
        known = ", ".join(sorted(m.cuda, key=vkey))
        return [f"CUDA {cuda} is not in the matrix (known: {known}, or cpu)"]
    releases = [torch] if torch is not None else list(m.torch)
    for minor in releases:
        rel = m.torch[minor]
        why: list[str] = []
        if cuda not in (None, "cpu") and cuda not in rel.all_cuda():
            why.append(f"torch {minor} does not ship CUDA {cuda} (it ships {', '.join(rel.all_cuda())}; "
                       f"source: {rel.source})")
        if python is not None and not rel.python.contains(python):
            why.append(f"torch {minor} supports Python {rel.python.min}-{rel.python.max}, not {python} "
                       f"(source: {rel.source})")
        if not why:
            return []
        reasons.extend(why)
    return reasons if torch is not None else [f"no torch release fits: {'; '.join(reasons)}"]


def _rule(spec: BaseModel) -> str:
    """'torch 2.9, cuda 13.0, python 3.12': a build rule as the error names it."""
    return ", ".join(f"{k} {v}" for k, v in spec.model_dump().items() if v is not None)


def _repeats(loc: tuple[str | int, ...], items: Sequence[str]) -> list[Problem]:
    """A list entry given twice (each would become its own cell, CI job or image tag): one problem per repeat."""
    seen: dict[str, int] = {}
    out: list[Problem] = []
    for i, item in enumerate(items):
        if item in seen:
            out.append(((*loc, i), f"{item!r} is listed twice (entries {seen[item]} and {i}); give each once"))
        else:
            seen[item] = i
    return out


def _abi_problems(name: str, pkg: Package) -> list[Problem]:
    """A stable-ABI package is an abi3 wheel with a Python floor; a per-cell one is neither."""
    loc = ("packages", name)
    if (pkg.sdist is None) == (pkg.git is None):
        return [(loc, "give its source as sdist (url, sha256) or git (url, commit), exactly one of the two")]
    if pkg.abi == "stable":
        out: list[Problem] = []
        if pkg.wheel_tag != "abi3":
            out.append(((*loc, "wheel_tag"), f"{pkg.wheel_tag!r}: a package with abi: stable is a limited-API wheel; "
                                             "allowed: 'abi3'"))
        if pkg.min_python is None:
            out.append(((*loc, "abi"), "abi: stable needs min_python (the oldest CPython of its abi3 tag, e.g. '3.9')"))
        return out
    if pkg.wheel_tag == "abi3":
        return [((*loc, "wheel_tag"), "'abi3' is for abi: stable packages (one wheel for every torch >= "
                                      "limits.min_torch); allowed: 'cpython', 'py39-none', or set abi: stable")]
    if pkg.min_python is not None:
        return [((*loc, "min_python"), "only for abi: stable packages (their abi3 floor); remove it")]
    return []


def problems(m: Matrix) -> list[Problem]:
    """Every fact that spans fields, checked ONCE, by the loader, which names the line of each: releases and
    their CUDAs are described, and every cell the build rules name (include, cpu, reference) is one that
    PyTorch's table allows. (location, message) each."""
    out: list[Problem] = []
    for minor, release in m.torch.items():
        parsed = Version(release.version)
        if f"{parsed.major}.{parsed.minor}" != minor:
            out.append((("torch", minor, "version"), f"{release.version} is not a {minor}.x release"))
        out += _repeats(("torch", minor, "platforms"), release.platforms)
        out += _repeats(("torch", minor, "cuda", "stable"), release.cuda.stable)
        out += _repeats(("torch", minor, "cuda", "experimental"), release.cuda.experimental)
        for i, cuda in enumerate(release.cuda.experimental):
            if cuda in release.cuda.stable:
                out.append((("torch", minor, "cuda", "experimental", i),
                            f"CUDA {cuda} is listed as both stable and experimental; allowed in one of the two"))
        for field_name, cudas in (("stable", release.cuda.stable), ("experimental", release.cuda.experimental)):
            for i, cuda in enumerate(cudas):
                if cuda not in m.cuda:
                    known = ", ".join(sorted(m.cuda, key=vkey))
                    out.append((("torch", minor, "cuda", field_name, i),
                                f"CUDA {cuda} has no entry under cuda: (described: {known})"))
    for pname, pkg in m.packages.items():
        out += _abi_problems(pname, pkg)
        if isinstance(pkg.archs, list):
            if not pkg.archs:
                out.append((("packages", pname, "archs"), "an empty list builds for no GPU; list {sm, min_cuda} "
                            "entries, or write torch (the cell's torch arch list)"))
            out += _repeats(("packages", pname, "archs"), [a.sm for a in pkg.archs])
    for name, pp in m.pypi_packages.items():
        out += _repeats(("pypi_packages", name, "archs"), pp.archs)
        for label, reqs in pp.requires.items():
            out += _repeats(("pypi_packages", name, "requires", label), reqs)
            pins = [_exact_pin(r) for r in reqs]
            if any(pin is None for pin in pins):
                bad = next(r for r, pin in zip(reqs, pins, strict=True) if pin is None)
                out.append((("pypi_packages", name, "requires", label), f"{bad!r} is not pinned with =="))
            elif pins[0] != (name, pp.version):
                out.append((("pypi_packages", name, "requires", label),
                            f"must start with {name}=={pp.version} (the package itself, at its version)"))
    for cuda_name, cuda_tk in m.cuda.items():
        out += _repeats(("cuda", cuda_name, "torch_arch_list"), cuda_tk.torch_arch_list)
        out += _repeats(("cuda", cuda_name, "torch_arch_list_arm64"), cuda_tk.torch_arch_list_arm64 or [])
    out += _repeats(("publish", "platforms"), m.publish.platforms)
    out += _repeats(("build", "python"), m.build.python)
    out += _repeats(("build", "include"), [_rule(s) for s in m.build.include])
    out += _repeats(("build", "exclude"), [_rule(s) for s in m.build.exclude])
    out += _repeats(("build", "cpu"), [_rule(s) for s in m.build.cpu])
    for i, spec in enumerate(m.build.exclude):
        if spec.torch is None and spec.cuda is None and spec.python is None:
            out.append((("build", "exclude", i), "an empty rule would exclude every cell; give torch, cuda and/or python"))
    for i, spec in enumerate(m.build.include):
        if spec.torch is None or spec.cuda is None or spec.python is None:
            out.append((("build", "include", i), "needs torch, cuda and python"))
            continue
        why = combination_reasons(m, spec.torch, spec.cuda, spec.python)
        if why:
            out.append((("build", "include", i), "; ".join(why)))
    for i, cpu in enumerate(m.build.cpu):
        why = combination_reasons(m, cpu.torch, "cpu", cpu.python)
        if why:
            out.append((("build", "cpu", i), "; ".join(why)))
    ref = m.reference_cell
    why = combination_reasons(m, ref.torch, ref.cuda, ref.python)
    if why:
        out.append((("reference_cell",), "; ".join(why)))
    return out
