"""FlashAttention-4 (`flash-attn-4` on PyPI, module `flash_attn.cute`): FlashAttention in CuTe DSL, a
pure-Python wheel whose kernels are JIT-compiled at first use of each configuration; no wheel build, no
torch-ABI match. Measured on the H200 against the plain SDPA call (docs/results/2026-11-30-h200-bench.json):
1.7-9x on sliding windows, ~6x on packed varlen, 1.2-2.6x on chunked prefill, 1.06-1.16x on long training calls;
slower on decode and small calls, which the selection rows (runtime/priority.py) keep away from it.

Limits per architecture, from flash_attn/cute/interface.py of 4.0.0b36 (the pinned release):
- sm90: (head_dim, head_dim_v) in 8..256, multiples of 16 bytes (`_validate_head_dims`); deterministic
  backward through semaphores. The only row run here (H200).
- sm100/sm110: head dims up to 128, plus the dedicated 256 kernels; (192, 128) is left out (q and v head
  dims differ, which attnkit declares for no FA4 row).
- sm120: SM80-style MMA in 99 KB of shared memory: tiles for head dims up to 128; no deterministic backward
  ("deterministic backward not supported on SM 12.0"); no split-KV.
sm8x has a forward kernel but no backward ("Supported: 9.x, 10.x, 11.x, 12.x"), so no row here. No dropout
argument; ALiBi and arbitrary bias only through score_mod, which attnkit does not use; fp8 is forward-only.

`import flash_attn.cute` takes ~4.6 s (CuTe DSL / MLIR), so nothing imports it until this backend is chosen
for a call or `attnkit doctor` / `attnkit warmup` asks. Just before that import, FA4's compiled-kernel disk
cache is switched on inside attnkit's cache folder, unless the user set FA4's own variables: a configuration
then compiles once per machine (seconds) instead of once per process.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from attnkit.runtime.backends.base import ArchLimits, Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params

ENV_CACHE_ENABLED = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
ENV_CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
MODULE = "flash_attn.cute"

_COMMON = Limits(dtypes=frozenset({"float16", "bfloat16"}), head_dim_multiple=8, gqa="native", varlen="native",
                 window=True, softcap=True)

_state: dict[str, Any] = {}  # "module", "import_s" or "error": the one import attempt of this process


def kernel_cache_dir() -> Path | None:
    """Where FA4 keeps compiled kernels: its own variable if set, else attnkit's cache folder; None when the
    user switched FA4's cache off."""
    from attnkit._io import cache_dir

    if os.environ.get(ENV_CACHE_ENABLED, "1") != "1":
        return None
    return Path(os.environ.get(ENV_CACHE_DIR) or cache_dir() / "flash-attn-4")


def load() -> Any:
    """Import flash_attn.cute once per process, its kernel cache set up first. Raises RuntimeError (so
    attention() falls back) with the import's own error; a failed import is not retried."""
    if "module" in _state:
        return _state["module"]
    if "error" in _state:
        raise RuntimeError(_state["error"])
    cache = kernel_cache_dir()
    if cache is not None:  # FA4 reads both variables when its cache module is imported: set them first
        os.environ.setdefault(ENV_CACHE_ENABLED, "1")
        os.environ.setdefault(ENV_CACHE_DIR, str(cache))
    t0 = time.perf_counter()
    try:
        import importlib

        module = importlib.import_module(MODULE)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        _state["error"] = f"{MODULE} does not import: {type(exc).__name__}: {first}"
        raise RuntimeError(_state["error"]) from exc
    _state["import_s"] = time.perf_counter() - t0
    _state["module"] = module
    return module


def import_seconds() -> float | None:
    return _state.get("import_s")


class FlashAttn4(Backend):
    name = "flash_attn4"
    library = "flash-attn-4"
    limits = (
        ArchLimits((9, 0), (9, 0), replace(_COMMON, max_head_dim=256, deterministic_backward=True)),
        ArchLimits((10, 0), (11, 9), replace(_COMMON, max_head_dim=128, extra_head_dims=frozenset({256}),
                                             deterministic_backward=True)),
        ArchLimits((12, 0), (12, 9), replace(_COMMON, max_head_dim=128)),
    )

    def extra_unavailable(self, probe: Any) -> list[str]:
        return [_state["error"]] if "error" in _state else []

    def import_library(self) -> float | None:
        load()
        return import_seconds()

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        fa = load()
        kw: dict[str, Any] = {"softmax_scale": p.scale, "causal": call.causal}
        if p.window is not None:  # attnkit's -1 (unbounded) is FA4's None; both align bottom-right
            kw["window_size"] = tuple(None if w < 0 else w for w in p.window)
        if call.softcap:
            kw["softcap"] = p.softcap
        if call.deterministic:
            kw["deterministic"] = True
        if call.varlen:
            fn = fa.flash_attn_varlen_func
            kw.update(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
                      max_seqlen_k=p.max_seqlen_k)
        else:
            fn = fa.flash_attn_func

        def run(q: Any, k: Any, v: Any) -> Any:
            out = fn(q, k, v, **kw)
            return out[0] if type(out) is tuple else out  # (out, lse) in 4.0 betas, out in others
        return run
