"""Per-package build recipes (attnkit/data/recipes/<name>.toml, linked from wheels/) as validated data, and the arch-list formats they need.

A recipe says how a package's setup.py is driven; the matrix says which version, sdist and archs. `resolve`
joins the two for one cell into a `BuildSpec`, the single description every later step works from.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    ValidationError,
    field_validator,
    model_validator,
)

from attnkit import data
from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.matrix.expand import Cell
from attnkit.matrix.schema import GitSource, Matrix

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# sm-semicolon "80;90" (flash-attn 2), dotted-semicolon "8.0;9.0" (TORCH_CUDA_ARCH_LIST); disable-sm80: FlashAttention-3's
# hopper/setup.py always compiles sm_90a and adds its _sm80.cu units unless FLASH_ATTENTION_DISABLE_SM80=TRUE
ArchFormat = Literal["sm-semicolon", "dotted-semicolon", "disable-sm80"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalSource(_Strict):
    path: str  # relative to the recipe file
    version: str
    archs: list[str] = Field(min_length=1)  # TORCH_CUDA_ARCH_LIST entries ("8.0", "9.0+PTX")
    # as matrix.yaml's packages.<name>.abi: "stable" builds one abi3 wheel for torch >= min_torch, Python >= min_python
    abi: Literal["cell", "stable"] = "cell"
    min_torch: str | None = Field(default=None, pattern=r"^[0-9]{1,4}\.[0-9]{1,4}$")
    min_python: str | None = Field(default=None, pattern=r"^3\.[0-9]{1,3}$")

    @model_validator(mode="after")
    def _stable_floors(self) -> LocalSource:
        if self.abi == "stable" and (self.min_torch is None or self.min_python is None):
            raise ValueError("abi 'stable' needs min_torch (its TORCH_TARGET_VERSION, e.g. '2.9') and min_python "
                             "(its abi3 floor, e.g. '3.9')")
        if self.abi == "cell" and (self.min_torch is not None or self.min_python is not None):
            raise ValueError("min_torch and min_python are for abi 'stable' only")
        return self


class BuildKnobs(_Strict):
    env: dict[str, str] = Field(default_factory=dict)
    arch_env: str
    arch_format: ArchFormat
    jobs_env: str = "MAX_JOBS"
    nvcc_threads_env: str | None = None
    nvcc_threads_value: str = "{threads}"
    nvcc_threads: int = Field(default=1, ge=1, le=16)
    memory_per_job_gib: float = Field(gt=0)
    # relative compile cost of a unit by its source path (fnmatch, first match; others cost 1): balances
    # sharded builds until a measured record (`wheels plan --costs`) is given
    unit_cost: dict[str, PositiveFloat] = Field(default_factory=dict)  # > 0: record seconds are scaled by them


class SourcePatch(_Strict):
    """A literal edit of the unpacked source for the cells whose torch its release cannot build with as shipped
    (flash-attn 2.8.3 and xformers 0.0.35 pin -std=c++17; torch >= 2.14's headers need C++20). Every occurrence
    of `old` is replaced; none found fails the build, since upstream then changed and the recipe must follow."""
    file: str  # relative to the source tree's root
    torch: str  # PEP 440 specifier on the cell's torch version, e.g. ">=2.14"
    old: str = Field(min_length=1)
    new: str
    why: str = Field(min_length=1)  # the upstream report or fix it follows

    @field_validator("torch")
    @classmethod
    def _specifier(cls, v: str) -> str:
        try:
            SpecifierSet(v)
        except InvalidSpecifier:
            raise ValueError(f"torch: {v!r} is not a version specifier (e.g. '>=2.14')") from None
        return v

    def describe(self) -> str:
        return f"{self.file}: {self.old!r} -> {self.new!r} (torch{self.torch}; {self.why})"


class Recipe(_Strict):
    name: str
    source: Literal["matrix"] | LocalSource
    extension_modules: list[str] = Field(min_length=1)
    # how the extension loads: a Python extension module (import), or a torch operator library without a
    # PyInit (xformers >= 0.0.34 loads its _C.so with torch.ops.load_library)
    extension_loader: Literal["import", "torch.ops.load_library"] = "import"
    import_modules: list[str] = Field(default_factory=list)
    build: BuildKnobs
    patches: list[SourcePatch] = Field(default_factory=list)
    # build switches a test build may set (`wheels build --option NAME=VALUE`), each with what it leaves out
    options: dict[str, str] = Field(default_factory=dict)

    def patches_for(self, torch_version: str) -> list[SourcePatch]:
        return [pt for pt in self.patches if SpecifierSet(pt.torch).contains(torch_version, prereleases=True)]


def load_recipe(package: str | None = None, path: str | Path | None = None) -> tuple[Recipe, Path]:
    """A recipe by package name (the packaged recipes/<name>.toml) or by file path; one-line errors."""
    if path is None:
        if package is None:
            raise AttnkitError("--package or --recipe: one is required")
        p = data.packaged(data.RECIPES, f"{package}.toml")
        if not p.is_file():
            known = ", ".join(data.recipe_names())
            raise AttnkitError(f"--package: no recipe for {package!r} (attnkit ships recipes for: {known}; "
                               f"--recipe FILE for another)")
    else:
        p = Path(path)
        if not p.is_file():
            raise AttnkitError(f"--recipe {p}: no such file")
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise AttnkitError(f"{p}: TOML syntax error: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AttnkitError(f"{p}: cannot be read as a UTF-8 TOML recipe ({type(exc).__name__})") from None
    try:
        recipe = Recipe.model_validate(doc)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if isinstance(doc.get("source"), dict):  # a local source: its own errors, not the "matrix" literal's
            errors = [x for x in errors if x["loc"][:2] != ("source", "literal['matrix']")] or errors
        e = errors[0]
        # a union member's tag ('LocalSource', 'function-after[...]') is pydantic's, not a key of the file
        loc = ".".join(str(x) for x in e["loc"] if x != "LocalSource" and not str(x).startswith("function-"))
        raise AttnkitError(f"{p}: {loc}: {e['msg']}") from None
    if package is not None and recipe.name != package:
        raise AttnkitError(f"{p}: name {recipe.name!r} does not match --package {package!r}")
    return recipe, p


# --- arch lists -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    sm: int  # 90
    ptx: bool = False


def parse_arch(entry: str) -> Arch:
    """'9.0', '9.0+PTX' or '90' -> Arch(90)."""
    m = re.fullmatch(r"(\d+)\.(\d+)(\+PTX)?", entry)
    if m:
        return Arch(int(m.group(1)) * 10 + int(m.group(2)), bool(m.group(3)))
    if re.fullmatch(r"\d{2,3}", entry):
        return Arch(int(entry))
    raise AttnkitError(f"arch {entry!r}: expected '9.0', '9.0+PTX' or '90'")


def format_archs(archs: list[Arch], fmt: ArchFormat) -> str:
    if fmt == "disable-sm80":
        sms = sorted(a.sm for a in archs)
        if 90 not in sms or not set(sms) <= {80, 90}:
            raise AttnkitError(f"archs {';'.join(map(str, sms))}: this package builds sm_90 always and sm_80 "
                               "optionally (FLASH_ATTENTION_DISABLE_SM80); allowed: 90, or 80;90")
        return "FALSE" if 80 in sms else "TRUE"
    if fmt == "sm-semicolon":
        return ";".join(str(a.sm) for a in archs)
    return ";".join(f"{a.sm // 10}.{a.sm % 10}" + ("+PTX" if a.ptx else "") for a in archs)


# --- recipe + matrix + cell -------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuildSpec:
    """Everything one (package, cell) build needs."""

    package: str
    version: str
    cell: Cell
    recipe: Recipe
    recipe_path: Path
    archs: tuple[Arch, ...]
    sdist_url: str | None
    sdist_sha256: str | None
    local_source: Path | None
    wheel_tag: str = "cpython"
    toolkit_pypi: str | None = None  # pip version spec of the CUDA toolkit wheels ("13.0.*")
    arch_subset: str | None = None  # set by restrict(): a test build for fewer archs, named '.sm90'
    abi: str = "cell"  # "stable": torch's stable C ABI + abi3 (matrix.yaml packages.<name>.abi)
    min_torch: str | None = None  # abi "stable": the torch floor (TORCH_TARGET_VERSION)
    min_python: str | None = None  # abi "stable": the abi3 floor
    git: GitSource | None = None  # a source pinned by commit (matrix.yaml packages.<name>.git), where no sdist is
    options: tuple[tuple[str, str], ...] = ()  # set by with_options(): recipe options of a trimmed test build

    def wheel_filename(self, machine: str) -> str:
        """The published name of this build (computed by the naming module, the only place names are made)."""
        cell = self.cell
        assert cell.cuda is not None
        if self.abi == "stable":
            assert self.min_torch is not None and self.min_python is not None
            return naming.stable_wheel_filename(self.package, self.version, cuda=cell.cuda, min_torch=self.min_torch,
                                                min_python=self.min_python, archs=[str(a.sm) for a in self.archs],
                                                machine=machine, trim=naming.options_marker(self.options))
        return naming.wheel_filename(self.package, self.version, cuda=cell.cuda, torch=cell.torch,
                                     cxx11_abi=cell.cxx11_abi, python=cell.python, wheel_tag=self.wheel_tag,
                                     arch_subset=self.arch_subset, machine=machine,
                                     trim=naming.options_marker(self.options))

    def torch_requirement(self) -> str:
        """What the wheel's METADATA requires of torch: the cell's minor (a C++-ABI build), or the floor of a
        stable-ABI build ('torch>=2.9')."""
        from attnkit.wheels.retag import torch_pin

        if self.abi == "stable":
            return f"torch>={self.min_torch}"
        return torch_pin(self.cell.torch)


def restrict(spec: BuildSpec, archs: str) -> BuildSpec:
    """The same build for a subset of the cell's archs (e.g. '90' for a quick build on one GPU). The wheel
    gets a marked local version, so it is never mistaken for the cell's full wheel."""
    import dataclasses

    wanted = tuple(parse_arch(a.strip()) for a in archs.replace(",", ";").split(";") if a.strip())
    have = {a.sm for a in spec.archs}
    extra = [a.sm for a in wanted if a.sm not in have]
    if not wanted or extra:
        raise AttnkitError(f"--archs {archs}: must be a non-empty subset of the cell's archs "
                           f"({';'.join(str(a.sm) for a in spec.archs)})")
    if {a.sm for a in wanted} == have:
        return spec
    by_sm = {a.sm: a for a in spec.archs}
    chosen = tuple(by_sm[a.sm] for a in wanted)
    return dataclasses.replace(spec, archs=chosen, arch_subset="".join(f"sm{a.sm}" for a in chosen))


_OPTION_VALUE = re.compile(r"[A-Za-z0-9._-]{1,64}", flags=re.ASCII)


def with_options(spec: BuildSpec, given: list[str]) -> BuildSpec:
    """The same build with recipe options set (`--option NAME=VALUE`, each NAME one the recipe declares under
    [options]): a trimmed test build, named apart (naming.options_marker)."""
    import dataclasses

    known = spec.recipe.options
    out: dict[str, str] = {}
    for item in given:
        name, eq, value = item.partition("=")
        if not eq or name not in known or not _OPTION_VALUE.fullmatch(value):
            allowed = ", ".join(known) or "none (the recipe declares no [options])"
            raise AttnkitError(f"--option {item[:80]!r}: expected NAME=VALUE with NAME one of the recipe's options "
                               f"({spec.recipe_path}: {allowed}) and VALUE letters, digits, '._-'")
        out[name] = value
    return dataclasses.replace(spec, options=tuple(sorted(out.items())))


def resolve(m: Matrix, cell: Cell, recipe: Recipe, recipe_path: Path, shared_ok: bool = False) -> BuildSpec:
    """`shared_ok`: a cell whose wheel another cell builds is accepted (a plan lists the same units anywhere)."""
    if cell.cuda is None:
        raise AttnkitError(f"--cell {cell.id}: a CPU cell has no CUDA toolkit; wheels are built for CUDA cells")
    if isinstance(recipe.source, LocalSource):
        src = (recipe_path.parent / recipe.source.path).resolve()
        ls = recipe.source
        if ls.abi == "stable":
            assert ls.min_torch is not None
            from attnkit.matrix.schema import vkey

            if vkey(cell.torch) < vkey(ls.min_torch):
                raise AttnkitError(f"--cell {cell.id}: {recipe.name} is a stable-ABI build for torch >= "
                                   f"{ls.min_torch} ({recipe_path}: source.min_torch); pick a cell of such a torch")
        return BuildSpec(recipe.name, ls.version, cell, recipe, recipe_path,
                         tuple(parse_arch(a) for a in ls.archs), None, None, src,
                         wheel_tag="abi3" if ls.abi == "stable" else "cpython",
                         toolkit_pypi=m.cuda[cell.cuda].toolkit_pypi, abi=ls.abi, min_torch=ls.min_torch,
                         min_python=ls.min_python)
    pkg = m.packages.get(recipe.name)  # type: ignore[call-overload]
    from attnkit.matrix import naming

    host = naming.host_platform()
    if host not in cell.platforms:
        raise AttnkitError(f"--cell {cell.id}: not published for {host}, this machine (its platforms: "
                           f"{', '.join(cell.platforms)}); a wheel is built on the machine it is for")
    build = cell.package(recipe.name, host)  # this machine's wheel: its archs (xformers: torch's for the machine)
    if pkg is None or build is None:
        from attnkit.matrix.expand import package_reasons

        why = package_reasons(recipe.name, pkg, cell.torch, cell.cuda, cell.python) if pkg else ["not in matrix.yaml"]
        raise AttnkitError(f"--cell {cell.id}: {recipe.name} is not built for this cell ({'; '.join(why)})")
    if build.built_in != cell.id and not shared_ok:
        raise AttnkitError(f"--cell {cell.id}: its {recipe.name} wheel ({build.wheel}) is shared and built in cell "
                           f"{build.built_in}; use --cell {build.built_in}")
    return BuildSpec(recipe.name, pkg.version, cell, recipe, recipe_path,
                     tuple(parse_arch(a) for a in build.archs), pkg.sdist.url if pkg.sdist else None,
                     pkg.sdist.sha256 if pkg.sdist else None, None, git=pkg.git,
                     wheel_tag=pkg.wheel_tag, toolkit_pypi=m.cuda[cell.cuda].toolkit_pypi, abi=pkg.abi,
                     min_torch=pkg.limits.min_torch if pkg.abi == "stable" else None, min_python=pkg.min_python)
