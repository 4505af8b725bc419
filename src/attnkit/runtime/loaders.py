"""The loaders of optional attention libraries whose import is slow or needs care: FlashAttention-4 (4-5 s of CuTe
DSL import, its kernel disk cache set up first) and xformers (an import that must not see FA4's namespace
package as flash-attn 2). Apart from the backends so that the machine probe can use them without importing any
backend module (no import cycle: probe -> loaders, backends -> loaders)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from attnkit.errors import first_line

FA4_CACHE_ENABLED = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
FA4_CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
FA4_MODULE = "flash_attn.cute"

FA4_STATE: dict[str, Any] = {}  # "module", "import_s" or "error": the one import attempt of this process


def fa4_kernel_cache_dir() -> Path | None:
    """Where FA4 keeps compiled kernels: its own variable if set, else attnkit's cache folder; None when the
    user switched FA4's cache off."""
    from attnkit._io import cache_dir

    if os.environ.get(FA4_CACHE_ENABLED, "1") != "1":
        return None
    return Path(os.environ.get(FA4_CACHE_DIR) or cache_dir() / "flash-attn-4")


def load_fa4() -> Any:
    """Import flash_attn.cute once per process, its kernel cache set up first. Raises RuntimeError (so
    attention() falls back) with the import's own error; a failed import is not retried."""
    if "module" in FA4_STATE:
        return FA4_STATE["module"]
    if "error" in FA4_STATE:
        raise RuntimeError(FA4_STATE["error"])
    cache = fa4_kernel_cache_dir()
    if cache is not None:  # FA4 reads both variables when its cache module is imported: set them first
        os.environ.setdefault(FA4_CACHE_ENABLED, "1")
        os.environ.setdefault(FA4_CACHE_DIR, str(cache))
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(FA4_MODULE)
    except Exception as exc:
        first = first_line(exc)
        FA4_STATE["error"] = f"{FA4_MODULE} does not import: {type(exc).__name__}: {first}"
        raise RuntimeError(FA4_STATE["error"]) from exc
    FA4_STATE["import_s"] = time.perf_counter() - t0
    FA4_STATE["module"] = module
    return module


def fa4_import_seconds() -> float | None:
    return FA4_STATE.get("import_s")


@functools.cache
def load_fmha() -> Any:
    """Import xformers.ops.fmha. Its flash module imports flash-attn 2 whenever `find_spec("flash_attn")` finds
    a package, and fails (No module named 'flash_attn.flash_attn_interface') when that package is only the
    namespace FlashAttention-4 installs (flash_attn/cute): seen on the H200 with xformers 0.0.35 next to
    flash-attn-4 4.0.0b36. Without flash-attn 2, xformers is meant to use torch's own flash kernel, so for
    that one import attnkit tells it the truth: flash-attn 2 is not installed."""
    if importlib.util.find_spec("flash_attn_2_cuda") is not None:  # flash-attn 2 is there: nothing to hide
        return importlib.import_module("xformers.ops.fmha")
    real = importlib.util.find_spec

    def without_namespace(name: str, package: str | None = None) -> Any:
        return None if name == "flash_attn" else real(name, package)

    importlib.util.find_spec = without_namespace  # type: ignore[assignment]
    try:
        return importlib.import_module("xformers.ops.fmha")
    finally:
        importlib.util.find_spec = real
