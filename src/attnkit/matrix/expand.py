"""Expand a validated Matrix into concrete cells (torch x CUDA|cpu x Python), apply include/exclude rules
and user filters, and check every requested combination against the compatibility facts.

A cell is published for one or more platforms (linux/amd64, linux/arm64): one image tag is a multi-arch
manifest over them, while its wheels are built per platform (their file names carry the machine), so a cell
holds one PackageBuild per package and platform."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from attnkit.errors import AttnkitError, UsageError
from attnkit.matrix import naming
from attnkit.matrix.schema import VARIANTS, CellSpec, Matrix, Package, PypiPackage, combination_reasons, vkey


@dataclass(frozen=True)
class PackageBuild:
    """One package as built for one cell."""

    name: str
    version: str
    archs: tuple[str, ...]  # SM numbers ("90") or TORCH_CUDA_ARCH_LIST entries ("9.0"), per the package
    wheel: str
    built_in: str  # id of the cell whose job builds this wheel (cells can share one wheel, see builders())
    shards: int = 1  # compile jobs in CI for this wheel (matrix.yaml packages.<name>.shards)
    abi: str = "cell"  # "stable": one wheel per CUDA major serves every cell of a torch >= min_torch
    min_torch: str | None = None  # abi "stable": the torch floor its wheel requires (torch>=min_torch)
    platform: str = "linux/amd64"  # the machine it is built on and for (its file name's platform tag)

    @property
    def machine(self) -> str:
        return naming.platform_machine(self.platform)


@dataclass(frozen=True)
class PypiBuild:
    """A PyPI-published library as one cell installs it (no build): its pins for the cell's CUDA major."""

    name: str
    version: str
    requirements: tuple[str, ...]
    archs: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    torch: str
    torch_version: str
    cuda: str | None
    python: str
    cxx11_abi: bool
    cuda_experimental: bool
    cuda_archs: tuple[str, ...]  # PyTorch's arch list on the cell's first platform
    packages: tuple[PackageBuild, ...]  # one per package and platform, the first platform's first
    pypi_packages: tuple[PypiBuild, ...]
    base_images: dict[str, str] = field(hash=False, compare=False)
    image_tags: dict[str, list[str]] = field(hash=False, compare=False)
    moving_tags: dict[str, list[str]] = field(hash=False, compare=False)
    platforms: tuple[str, ...] = ("linux/amd64",)
    platform_archs: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        return naming.cell_id(self.torch, self.cuda, self.python)

    def package(self, name: str, platform: str | None = None) -> PackageBuild | None:
        """`name` as built for `platform` (default: the cell's first platform)."""
        platform = platform or self.platforms[0]
        return next((p for p in self.packages if p.name == name and p.platform == platform), None)

    def packages_on(self, platform: str | None = None) -> tuple[PackageBuild, ...]:
        platform = platform or self.platforms[0]
        return tuple(p for p in self.packages if p.platform == platform)

    def pypi_package(self, name: str) -> PypiBuild | None:
        return next((p for p in self.pypi_packages if p.name == name), None)


@dataclass(frozen=True)
class CellFilter:
    torch: str | None = None
    cuda: str | None = None  # "X.Y" or "cpu"
    python: str | None = None
    package: str | None = None
    platform: str | None = None  # "linux/amd64" or "linux/arm64": cells published for it


def cell_platforms(m: Matrix, torch: str, cuda: str | None) -> tuple[str, ...]:
    """The platforms a cell is published for, in publish.platforms' order: those its torch release has wheels
    for and, for a CUDA cell, whose arch list of that CUDA is known (matrix.yaml torch_arch_list[_arm64])."""
    rel = m.torch[torch]
    return tuple(p for p in m.publish.platforms
                 if p in rel.platforms and (cuda is None or m.cuda[cuda].arch_list(p) is not None))


def package_reasons(pkg_name: str, pkg: Package | PypiPackage, torch: str, cuda: str | None,
                    python: str | None = None) -> list[str]:
    """Why a package is not built for a cell; [] when it is."""
    lim = pkg.limits
    if cuda is None:
        return [f"{pkg_name} needs CUDA (this is a CPU cell)"]
    reasons = []
    if isinstance(pkg, Package) and pkg.min_python is not None and python is not None \
            and vkey(python) < vkey(pkg.min_python):
        reasons.append(f"{pkg_name} {pkg.version} needs Python >= {pkg.min_python}")
    if vkey(cuda) < vkey(lim.min_cuda):
        reasons.append(f"{pkg_name} {pkg.version} needs CUDA >= {lim.min_cuda}")
    if vkey(torch) < vkey(lim.min_torch):
        reasons.append(f"{pkg_name} {pkg.version} needs torch >= {lim.min_torch}")
    return reasons


def _package_archs(m: Matrix, pkg: Package, cuda: str, platform: str) -> tuple[str, ...]:
    if pkg.archs == "torch":
        return tuple(m.cuda[cuda].arch_list(platform) or ())
    return tuple(a.sm for a in pkg.archs if vkey(cuda) >= vkey(a.min_cuda))


def _matches(spec: CellSpec, torch: str, cuda: str | None, python: str) -> bool:
    return ((spec.torch is None or spec.torch == torch)
            and (spec.cuda is None or spec.cuda == cuda)
            and (spec.python is None or spec.python == python))


def _newest_python(cells: list[tuple[str, str | None, str]]) -> dict[tuple[str, str | None], str]:
    newest: dict[tuple[str, str | None], str] = {}
    for torch, cuda, python in cells:
        cur = newest.get((torch, cuda))
        if cur is None or vkey(python) > vkey(cur):
            newest[(torch, cuda)] = python
    return newest


def _stable_builds(m: Matrix, triples: list[tuple[str, str | None, str]]
                   ) -> dict[tuple[str, str, str], tuple[str, tuple[str, str, str]]]:
    """(package, CUDA major label, platform) -> (wheel file name, the (torch, cuda, python) that builds it), for
    the stable-ABI packages: ONE wheel per CUDA major and platform serves every cell of that major whose torch
    and Python are at or above the package's floors. Its builder: a cell whose toolkit gives the most archs;
    among those the reference cell's torch and CUDA (the machine we test on builds what it tests: any torch at
    or above the floor builds the same stable-ABI wheel), else the newest toolkit, then the newest torch; then
    the reference cell's Python. The arch set in the name is the builder's."""
    ref = m.reference_cell
    best: dict[tuple[str, str, str], tuple[str, str, str]] = {}

    def rank(pkg: Package, t: tuple[str, str, str], platform: str) -> tuple[object, ...]:
        return (len(_package_archs(m, pkg, t[1], platform)), (t[0], t[1]) == (ref.torch, ref.cuda), vkey(t[1]),
                vkey(t[0]), t[2] == ref.python, vkey(t[2]))

    for torch, cuda, python in triples:
        if cuda is None:
            continue
        for platform in cell_platforms(m, torch, cuda):
            for name, pkg in m.packages.items():
                if pkg.abi != "stable" or package_reasons(name, pkg, torch, cuda, python):
                    continue
                k = (str(name), naming.cuda_label(cuda), platform)
                if k not in best or rank(pkg, (torch, cuda, python), platform) > rank(pkg, best[k], platform):
                    best[k] = (torch, cuda, python)
    out: dict[tuple[str, str, str], tuple[str, tuple[str, str, str]]] = {}
    for (pname, label, platform), (bt, bc, bp) in best.items():
        pkg = m.packages[pname]  # type: ignore[index]
        assert pkg.min_python is not None  # schema.problems: abi stable has min_python
        fname = naming.stable_wheel_filename(pname, pkg.version, cuda=bc, min_torch=pkg.limits.min_torch,
                                             min_python=pkg.min_python, archs=_package_archs(m, pkg, bc, platform),
                                             machine=naming.platform_machine(platform))
        out[(pname, label, platform)] = (fname, (bt, bc, bp))
    return out


def _wheel_name(m: Matrix, name: str, pkg: Package, torch: str, cuda: str, python: str, platform: str) -> str:
    return naming.wheel_filename(name, pkg.version, cuda=cuda, torch=torch, cxx11_abi=m.torch[torch].cxx11_abi,
                                 python=python, wheel_tag=pkg.wheel_tag, machine=naming.platform_machine(platform))


def builders(m: Matrix, triples: list[tuple[str, str | None, str]]) -> dict[str, tuple[str, str, str]]:
    """Wheel file name -> the (torch, cuda, python) that builds it.

    Names carry only the CUDA major (upstream's scheme), so cu126 and cu128 cells of one torch share a
    flash-attn wheel, and xformers' py39-none wheel serves every Python; they carry the machine too, so each
    platform's wheel has its own builder among the cells published for that platform. Like upstream, the
    shared wheel is built with the newest toolkit among them (most archs: sm100/sm120 need nvcc >= 12.8) and
    runs on the others through CUDA minor-version compatibility. Among Pythons (a py39-none wheel) the reference cell's
    Python builds it, so the machine we test on builds what it tests.
    """
    ref_py = m.reference_cell.python

    def rank(cuda: str, python: str) -> tuple[object, ...]:
        return (vkey(cuda), python == ref_py, vkey(python))

    out: dict[str, tuple[str, str, str]] = {}
    for torch, cuda, python in triples:
        if cuda is None:
            continue
        for platform in cell_platforms(m, torch, cuda):
            for name, pkg in m.packages.items():
                if pkg.abi == "stable" or package_reasons(name, pkg, torch, cuda, python):
                    continue
                fname = _wheel_name(m, name, pkg, torch, cuda, python, platform)
                cur = out.get(fname)
                if cur is None or rank(cuda, python) > rank(cur[1], cur[2]):
                    out[fname] = (torch, cuda, python)
    for fname, builder in _stable_builds(m, triples).values():
        out[fname] = builder
    return out


def _make_cell(m: Matrix, torch: str, cuda: str | None, python: str, newest: bool,
               builder: dict[str, tuple[str, str, str]],
               stable: dict[tuple[str, str, str], tuple[str, tuple[str, str, str]]]) -> Cell:
    rel = m.torch[torch]
    platforms = cell_platforms(m, torch, cuda)
    packages: list[PackageBuild] = []
    for platform in platforms:
        if cuda is None:
            break
        for name, pkg in m.packages.items():
            if package_reasons(name, pkg, torch, cuda, python):
                continue
            if pkg.abi == "stable":
                wheel = stable[(name, naming.cuda_label(cuda), platform)][0]
            else:
                wheel = _wheel_name(m, name, pkg, torch, cuda, python, platform)
            bt, bc, bp = builder[wheel]
            packages.append(PackageBuild(name, pkg.version, _package_archs(m, pkg, bc, platform), wheel,
                                         naming.cell_id(bt, bc, bp), pkg.shards, pkg.abi,
                                         pkg.limits.min_torch if pkg.abi == "stable" else None, platform))
    pypi: list[PypiBuild] = []
    for pname, pp in m.pypi_packages.items():
        if cuda is None or package_reasons(pname, pp, torch, cuda) or vkey(python) > vkey(pp.max_python):
            continue
        reqs = pp.requires.get(naming.cuda_label(cuda))  # type: ignore[call-overload]
        if reqs:
            pypi.append(PypiBuild(pname, pp.version, tuple(reqs), tuple(pp.archs)))
    images = m.cuda[cuda].images if cuda is not None else m.cpu.images
    cid = naming.cell_id(torch, cuda, python)
    ref = m.reference_cell
    is_ref = (ref.torch, ref.cuda, ref.python) == (torch, cuda, python)
    return Cell(
        torch=torch,
        torch_version=rel.version,
        cuda=cuda,
        python=python,
        cxx11_abi=rel.cxx11_abi,
        cuda_experimental=cuda is not None and cuda in rel.cuda.experimental,
        cuda_archs=tuple(m.cuda[cuda].arch_list(platforms[0]) or ()) if cuda is not None else (),
        packages=tuple(packages),
        pypi_packages=tuple(pypi),
        base_images={v: getattr(images, v).ref() for v in VARIANTS},
        image_tags={v: [naming.image_tag(m.publish.registry, m.publish.image, cid, v)] for v in VARIANTS},
        moving_tags={v: naming.moving_tags(m.publish.registry, m.publish.image, torch, cuda, v, newest, is_ref)
                     for v in VARIANTS},
        platforms=platforms,
        platform_archs={p: tuple(m.cuda[cuda].arch_list(p) or ()) for p in platforms} if cuda is not None else {},
    )


def all_cells(m: Matrix) -> list[Cell]:
    """Every cell the build rules produce, CUDA cells first, sorted by torch, CUDA, Python. The rules were
    checked against the compatibility facts once, when the matrix was loaded (schema.problems)."""
    triples: list[tuple[str, str | None, str]] = []
    for torch in sorted(m.torch, key=vkey):
        rel = m.torch[torch]
        for cuda in rel.cuda.stable:
            for python in m.build.python:
                if rel.python.contains(python):
                    triples.append((torch, cuda, python))
    triples = [t for t in triples if not any(_matches(s, *t) for s in m.build.exclude)]
    for spec in m.build.include:
        assert spec.torch is not None and spec.cuda is not None and spec.python is not None
        if (spec.torch, spec.cuda, spec.python) not in triples:
            triples.append((spec.torch, spec.cuda, spec.python))
    triples += [(cpu.torch, None, cpu.python) for cpu in m.build.cpu]
    triples = [t for t in triples if cell_platforms(m, t[0], t[1])]  # published for none of our platforms
    triples.sort(key=lambda t: (t[1] is None, vkey(t[0]), vkey(t[1] or "0.0"), vkey(t[2])))
    newest = _newest_python(triples)
    builder = builders(m, triples)
    stable = _stable_builds(m, triples)
    return [_make_cell(m, t, c, p, newest[(t, c)] == p, builder, stable) for t, c, p in triples]


def _check_filter(m: Matrix, f: CellFilter) -> None:
    """A value the matrix does not know is a usage error (exit 2, like any bad option value); a combination of
    known values that PyTorch's table forbids is a failure (exit 1)."""
    if f.package is not None and f.package not in m.packages:
        raise UsageError(f"--package: unknown package {f.package!r}; allowed: {', '.join(m.packages)}")
    if f.torch is not None and f.torch not in m.torch:
        raise UsageError(f"--torch: torch {f.torch} is not in the matrix (known: {', '.join(sorted(m.torch, key=vkey))})")
    if f.platform is not None and f.platform not in m.publish.platforms:
        raise UsageError(f"--platform: {f.platform!r} is not published (publish.platforms in matrix.yaml: "
                         f"{', '.join(m.publish.platforms)})")
    if f.cuda not in (None, "cpu") and f.cuda not in m.cuda:
        raise UsageError(f"--cuda: CUDA {f.cuda} is not in the matrix (known: {', '.join(sorted(m.cuda, key=vkey))}, "
                         "or cpu)")
    why = combination_reasons(m, f.torch, f.cuda, f.python)
    if why:
        raise AttnkitError(f"--torch/--cuda/--python: {'; '.join(why)}")


def expand(m: Matrix, f: CellFilter | None = None) -> list[Cell]:
    """The cells to build, narrowed by `f`. A filter that PyTorch's table forbids, or that matches nothing,
    is an error (an empty CI matrix should never pass silently)."""
    f = f or CellFilter()
    _check_filter(m, f)
    cells = all_cells(m)
    out = [
        c for c in cells
        if (f.torch is None or c.torch == f.torch)
        and (f.cuda is None or (c.cuda or "cpu") == f.cuda)
        and (f.python is None or c.python == f.python)
        and (f.platform is None or f.platform in c.platforms)
        and (f.package is None or c.package(f.package, f.platform) is not None)
    ]
    if not out:
        asked = ", ".join(f"--{k} {v}" for k, v in vars(f).items() if v is not None)
        if f.platform is not None and expand_or_none(m, replace(f, platform=None)):
            raise AttnkitError(f"{asked}: no such cell is published for {f.platform}: a cell gets it where its torch "
                               f"release lists it (torch.<minor>.platforms) and, for CUDA, where its CUDA has "
                               f"torch_arch_list_arm64 in matrix.yaml")
        if f.package is not None and f.cuda == "cpu":
            raise AttnkitError(f"{asked}: {f.package} needs CUDA; CPU cells carry no prebuilt wheels")
        if f.package is not None:
            pkg = m.packages[f.package]  # type: ignore[index]  # checked by _check_filter
            lim = pkg.limits
            raise AttnkitError(f"{asked}: no cell is built for {f.package} {pkg.version} (it needs torch >= "
                               f"{lim.min_torch}, CUDA >= {lim.min_cuda})")
        raise AttnkitError(f"{asked}: compatible, but no such cell is built; see build: in matrix.yaml "
                           f"(include adds cells)")
    return out


def expand_or_none(m: Matrix, f: CellFilter) -> list[Cell]:
    try:
        return expand(m, f)
    except AttnkitError:
        return []


def find_cell(m: Matrix, cid: str) -> Cell:
    """The cell with this id, or an error listing the nearest ones."""
    cells = all_cells(m)
    for c in cells:
        if c.id == cid:
            return c
    import difflib

    near = difflib.get_close_matches(cid, [c.id for c in cells], n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(near)}?" if near else f"; see `attnkit matrix` ({len(cells)} cells)"
    raise UsageError(f"--cell: unknown cell {cid!r}{hint}")
