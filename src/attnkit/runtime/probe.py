"""A cached, immutable record of this machine: GPUs, driver, torch build, and attention libraries.

GPU facts come from NVML (nvidia-ml-py) when it is installed, so probing does not create a CUDA context;
torch.cuda is asked only when NVML cannot answer. Works with no GPU and with no torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata as md
import importlib.util
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    capability: tuple[int, int]
    memory_mib: int
    sm_count: int | None  # NVML does not report SM count; filled from torch when it is already initialised

    @property
    def sm(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


@dataclass(frozen=True)
class Library:
    """An attention library as installed: `loads` is False when it imports but its extension does not.
    `checked` is False for a library whose import the probe defers because it is slow (FlashAttention-4:
    ~4.6 s); `attnkit doctor` imports it, and a backend that uses it finds out at its first call."""

    name: str
    module: str
    version: str | None
    installed: bool
    loads: bool
    error: str | None = None
    checked: bool = True
    detail: str | None = None  # e.g. the version of a runtime it depends on


@dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda: str | None
    cudnn: int | None
    cxx11_abi: bool
    cuda_available: bool


@dataclass(frozen=True)
class Probe:
    python: str
    platform: str
    driver: str | None
    gpus: tuple[GPU, ...]
    torch: TorchInfo | None
    libraries: tuple[Library, ...]
    source: str  # "nvml", "torch" or "none": where GPU facts came from
    notes: tuple[str, ...] = field(default_factory=tuple)
    torch_error: str | None = None  # torch is installed but `import torch` failed: the diagnosis

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def library(self, name: str) -> Library | None:
        return next((lib for lib in self.libraries if lib.name == name), None)

    def capability(self, device_index: int = 0) -> tuple[int, int] | None:
        for g in self.gpus:
            if g.index == device_index:
                return g.capability
        return None

    def fingerprint(self) -> str:
        """What a cached autotune result depends on: GPU, driver, torch, library versions."""
        gpu = self.gpus[0].name if self.gpus else "cpu"
        libs = ",".join(f"{lib.name}={lib.version}" for lib in self.libraries if lib.installed)
        tv = self.torch.version if self.torch else "none"
        return f"{gpu}|driver={self.driver}|torch={tv}|{libs}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nvml() -> tuple[str | None, tuple[GPU, ...]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)
            gpus.append(GPU(i, name, (int(major), int(minor)), int(mem), None))
        return driver, tuple(gpus)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _torch_info() -> TorchInfo | str | None:
    """torch's facts; None when it is not installed; the one-line diagnosis when it is but does not import."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
    except Exception as exc:  # a broken install (missing libcudnn, undefined symbol): the case a doctor is for
        from attnkit.errors import torch_import_failure

        return torch_import_failure(f"{type(exc).__name__}: {exc}")

    cudnn = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        cudnn = None
    return TorchInfo(
        version=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=cudnn,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        cuda_available=bool(torch.cuda.is_available()),
    )


def _torch_gpus() -> tuple[GPU, ...]:
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(GPU(i, p.name, (p.major, p.minor), p.total_memory // (1024 * 1024), p.multi_processor_count))
    return tuple(gpus)


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def _short(exc: BaseException) -> str:
    """One line; a first line that ends in ':' is joined with the next two (xformers: "built for:" + what)."""
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    keep = lines[:3] if lines[0].endswith(":") else lines[:1]
    return " ".join(keep)[:300]


def _probe_import(row: LibraryRow) -> Library:
    version = _dist_version(*row.dists)
    module = next((m for m in row.modules if importlib.util.find_spec(m)), row.modules[0])
    if version is None and importlib.util.find_spec(row.extension or module) is None:
        return Library(row.name, module, None, installed=False, loads=False)
    try:
        importlib.import_module(row.extension or module)
    except Exception as exc:  # an extension built for another torch/CUDA: "undefined symbol", ...
        return Library(row.name, module, version, installed=True, loads=False, error=_short(exc))
    return Library(row.name, module, version, installed=True, loads=True)


def _probe_xformers(row: LibraryRow) -> Library:
    version = _dist_version("xformers")
    if importlib.util.find_spec("xformers") is None:
        return Library("xformers", "xformers", version, installed=False, loads=False)
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            xf = importlib.import_module("xformers")
        if not getattr(xf, "_has_cpp_library", False):
            cpp = importlib.import_module("xformers._cpp_lib")
            err = getattr(cpp, "_cpp_library_load_exception", None)
            return Library("xformers", "xformers", version, True, False,
                           error=_short(err) if err else "C++/CUDA extension did not load")
        from attnkit.runtime.loaders import load_fmha

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_fmha()  # the operators attnkit calls: they import flash-attn 2 when they find it
    except Exception as exc:
        return Library("xformers", "xformers", version, installed=True, loads=False, error=_short(exc))
    return Library("xformers", "xformers", version, installed=True, loads=True)


def _probe_deferred(row: LibraryRow) -> Library:
    """Installed-ness from the distribution's own files, without importing anything (flash-attn-4 shares the
    `flash_attn` package folder with flash-attn 2, whose import loads its CUDA extension)."""
    version = _dist_version(*row.dists)
    installed = False
    if version is not None:
        dist = md.distribution(next(d for d in row.dists if _dist_version(d) == version))
        init = row.modules[0].replace(".", "/") + "/__init__.py"
        installed = Path(str(dist.locate_file(init))).is_file()
    detail = None
    if row.runtime is not None:
        rt = _dist_version(row.runtime)
        detail = f"{row.runtime} {rt}" if rt else f"{row.runtime} is not installed"
    note = "not imported yet: its import takes seconds; `attnkit doctor` imports it" if installed else None
    return Library(row.name, row.modules[0], version, installed=installed, loads=False, error=note, checked=False,
                   detail=detail)


@dataclass(frozen=True)
class LibraryRow:
    """How to probe one attention library: its import names, distribution names, and the extension module
    that must load (None: the module itself)."""

    name: str
    modules: tuple[str, ...]  # the first one installed is probed
    dists: tuple[str, ...]
    extension: str | None = None
    deferred: bool = False  # slow to import: found from its files, imported only when used
    runtime: str | None = None  # a distribution whose version doctor shows next to it
    prober: Any = None  # a library whose own loader is asked instead (xformers)


LIBRARIES: tuple[LibraryRow, ...] = (
    LibraryRow("flash-attn", ("flash_attn",), ("flash-attn", "flash_attn"), "flash_attn_2_cuda"),
    LibraryRow("flash-attn-3", ("flash_attn_interface", "flash_attn_3"), ("flash-attn-3", "flash_attn_3")),
    LibraryRow("flash-attn-4", ("flash_attn.cute",), ("flash-attn-4",), deferred=True, runtime="nvidia-cutlass-dsl"),
    LibraryRow("xformers", ("xformers",), ("xformers",), prober=_probe_xformers),
    LibraryRow("cudnn-frontend", ("cudnn",), ("nvidia-cudnn-frontend",)),
)


def _libraries(with_torch: bool) -> tuple[Library, ...]:
    out = []
    for row in LIBRARIES:
        if row.deferred:
            out.append(_probe_deferred(row))
        elif not with_torch:
            module = next((m for m in row.modules if importlib.util.find_spec(m)), row.modules[0])
            out.append(Library(row.name, module, _dist_version(*row.dists),
                               importlib.util.find_spec(module) is not None, False, "torch is not installed"))
        else:
            out.append((row.prober or _probe_import)(row))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def probe() -> Probe:
    """Probe once per process; the result is immutable."""
    notes: list[str] = []
    nv = _nvml()
    info = _torch_info()
    t = info if isinstance(info, TorchInfo) else None
    torch_error = info if isinstance(info, str) else None
    if torch_error is not None:
        notes.append(f"{torch_error}: no attention backend can run")
    elif t is None:
        notes.append("torch is not installed: no attention backend can run")
    if nv is not None:
        driver, gpus = nv
        source = "nvml"
        if t is not None and t.cuda_available and gpus:
            import torch

            if torch.cuda.is_initialized():  # SM count is free once a context exists
                by_index = {g.index: g for g in _torch_gpus()}
                gpus = tuple(GPU(g.index, g.name, g.capability, g.memory_mib,
                                 by_index[g.index].sm_count if g.index in by_index else None) for g in gpus)
    elif t is not None and t.cuda_available:
        driver, gpus, source = None, _torch_gpus(), "torch"
        notes.append("nvidia-ml-py not installed: GPU facts read through torch.cuda (creates a CUDA context)")
    else:
        driver, gpus, source = None, (), "none"
        if t is not None and t.cuda is None:
            notes.append(f"torch {t.version} is a CPU build")
        elif t is not None:
            notes.append("no CUDA GPU visible")
    return Probe(
        python=platform.python_version(),
        platform=f"{sys.platform}-{platform.machine()}",
        driver=driver,
        gpus=gpus,
        torch=t,
        libraries=_libraries(t is not None),
        source=source,
        notes=tuple(notes),
        torch_error=torch_error,
    )
