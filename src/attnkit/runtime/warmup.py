"""`attnkit warmup`: pay JIT compilation once, ahead of time, instead of inside the first step of every new
process. FlashAttention-4 compiles each new configuration at first use (2-5 s forward, 4-7 s backward on the
H200, docs/results/2026-11-30-h200-fa4-warmup.json) and keeps the result in its disk cache, which attnkit points into its own cache folder;
warmup runs attention() once (forward, and backward for training shapes) for each shape of a list, so every
kernel those calls select is compiled and stored before a training job or server starts, or in an image build
on a GPU runner. Shapes come from a JSON file or from a Hugging Face model's config.json.

The report gives, per shape, the backend attention() chose and the first call's time: cold when the kernels
were compiled now, warm when they came from the cache.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from attnkit.errors import AttnkitError

DTYPES = ("float16", "bfloat16")


class WarmupShape(BaseModel):
    """One attention call to compile for: the JSON file is a list of these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str = ""
    batch: int = Field(1, ge=1)
    seqlen: int | None = Field(None, ge=1, description="queries = keys (self-attention)")
    seqlen_q: int | None = Field(None, ge=1)
    seqlen_k: int | None = Field(None, ge=1)
    heads: int = Field(ge=1)
    kv_heads: int | None = Field(None, ge=1)
    head_dim: int = Field(ge=1)
    dtype: Literal["float16", "bfloat16"] = "bfloat16"
    causal: bool = True
    window: tuple[int, int] | None = None
    softcap: float = Field(0.0, ge=0)
    lengths: tuple[int, ...] | None = Field(None, description="packed varlen: per-sequence lengths")
    train: bool = True

    @model_validator(mode="after")
    def _check(self) -> WarmupShape:
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {kv}")
        if self.window is not None and min(self.window) < -1:
            raise ValueError(f"window {self.window}: (left, right) ints >= -1 (-1 = unbounded)")
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError("lengths: a non-empty list of sequence lengths >= 1")
        if self.lengths is None and self.seqlen is None and (self.seqlen_q is None or self.seqlen_k is None):
            raise ValueError("give seqlen, or seqlen_q and seqlen_k, or lengths (varlen)")
        return self

    def sizes(self) -> tuple[int, int]:
        if self.lengths is not None:
            return max(self.lengths), max(self.lengths)
        return (self.seqlen_q or self.seqlen or 0), (self.seqlen_k or self.seqlen or 0)

    def name(self) -> str:
        sq, sk = self.sizes()
        kind = "varlen" if self.lengths else f"Sq={sq} Sk={sk}"
        return self.label or (f"{self.dtype} B={self.batch} {kind} H={self.heads}/{self.kv_heads or self.heads} "
                              f"D={self.head_dim}{' causal' if self.causal else ''}"
                              f"{f' window={self.window}' if self.window else ''}{' train' if self.train else ''}")


def load_shapes(path: str) -> list[WarmupShape]:
    """A JSON list of shapes; one-line errors that name the file, the entry and the field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise AttnkitError(f"--shapes {path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise AttnkitError(f"--shapes {path}: not JSON ({exc})") from None
    if not isinstance(data, list) or not data:
        raise AttnkitError(f"--shapes {path}: expected a non-empty JSON list of shapes")
    out = []
    for i, item in enumerate(data):
        try:
            out.append(WarmupShape.model_validate(item))
        except ValidationError as exc:
            e = exc.errors()[0]
            where = "".join(f"{x}: " for x in e["loc"])
            raise AttnkitError(f"--shapes {path}: entry {i}: {where}{e['msg'].removeprefix('Value error, ')}") from None
    return out


def shapes_from_model(path: str, seqlen: int, batch: int, dtype: str | None) -> list[WarmupShape]:
    """The attention calls of a Hugging Face model (config.json, or the folder holding it): a training step
    at `seqlen`, a prefill and a decode step against a `seqlen` cache; sliding-window and softcap settings
    (Mistral, Gemma 2/3, Qwen) carried over."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AttnkitError(f"--model {cfg_path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise AttnkitError(f"--model {cfg_path}: not JSON ({exc})") from None
    cfg = {**cfg, **cfg.get("text_config", {})}  # multimodal configs keep the language model's here
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise AttnkitError(f"--model {cfg_path}: needs num_attention_heads and head_dim or hidden_size ({exc})") from None
    dt = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dt not in DTYPES:
        dt = "bfloat16"
    softcap = float(cfg.get("attn_logit_softcapping") or 0.0)
    sw = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types") or []
    windows: list[tuple[int, int] | None] = []
    if sw and (not layer_types or "sliding_attention" in layer_types):
        windows.append((int(sw) - 1, 0))  # HF's window counts the query itself, as flash-attn's left + 1
    if not sw or "full_attention" in layer_types:
        windows.append(None)
    out = []
    name = cfg_path.parent.name or "model"
    for w in windows:
        tag = f" window {w[0] + 1}" if w else ""
        base = WarmupShape.model_validate({"heads": heads, "kv_heads": kv, "head_dim": head_dim, "dtype": dt,
                                           "window": w, "softcap": softcap, "batch": batch, "seqlen": seqlen})
        out += [base.model_copy(update={"label": f"{name} train B={batch} S={seqlen}{tag}"}),
                base.model_copy(update={"label": f"{name} prefill B={batch} S={seqlen}{tag}", "train": False}),
                base.model_copy(update={"label": f"{name} decode B={batch} Sk={seqlen}{tag}", "train": False,
                                        "seqlen": None, "seqlen_q": 1, "seqlen_k": seqlen})]
    return out


def warm_one(s: WarmupShape, device: str) -> dict[str, Any]:
    """attention() on this shape twice: the first call's time (compile, or cache load), then a plain call."""
    import torch

    from attnkit.runtime.attention import attention
    from attnkit.runtime.call import Inputs
    from attnkit.runtime.select import select

    dt = getattr(torch, s.dtype)
    kv = s.kv_heads or s.heads
    sq, sk = s.sizes()
    kw: dict[str, Any] = {"causal": s.causal, "window": s.window, "softcap": s.softcap}
    if s.lengths is not None:
        total = sum(s.lengths)
        cu = torch.tensor([0, *torch.tensor(s.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=sq, max_seqlen_k=sk)
        shapes: list[tuple[int, ...]] = [(total, s.heads, s.head_dim), (total, kv, s.head_dim)]
    else:
        shapes = [(s.batch, sq, s.heads, s.head_dim), (s.batch, sk, kv, s.head_dim)]
    q = torch.randn(*shapes[0], device=device, dtype=dt, requires_grad=s.train)
    k = torch.randn(*shapes[1], device=device, dtype=dt, requires_grad=s.train)
    v = torch.randn(*shapes[1], device=device, dtype=dt, requires_grad=s.train)
    with torch.set_grad_enabled(s.train):
        backend = select(Inputs(q, k, v, **kw).describe()).name
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(s.train):
            out = attention(q, k, v, **kw)
            if s.train:
                out.sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"shape": s.name(), "backend": backend, "first_call_s": round(times[0], 4),
            "second_call_s": round(times[1], 4)}


def run_warmup(shapes: list[WarmupShape], report: str | None = None, dry_run: bool = False,
               as_json: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    from attnkit._io import write_atomic
    from attnkit.runtime.loaders import fa4_import_seconds, fa4_kernel_cache_dir
    from attnkit.runtime.probe import probe

    p = probe()
    gpu = p.torch is not None and p.torch.cuda_available and p.has_gpu
    if not gpu and not dry_run:
        raise AttnkitError("warmup: no CUDA GPU visible: it compiles GPU kernels, so run it on the target machine "
                           "(or --dry-run to list the backends that would be compiled for)")
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    if not dry_run and any(_planned(s, p) == "flash_attn4" for s in shapes):
        from attnkit.runtime.loaders import load_fa4 as load

        load()  # its ~3-5 s import is reported on its own, not inside the first shape's time
    for s in shapes:
        if dry_run:
            rows.append({"shape": s.name(), "backend": _planned(s, p), "first_call_s": None, "second_call_s": None})
        else:
            rows.append(warm_one(s, "cuda"))
    cache = fa4_kernel_cache_dir()
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": dry_run,
           "gpu": p.gpus[0].name if p.gpus else None, "total_s": round(time.perf_counter() - t_all, 3),
           "flash_attn4_import_s": fa4_import_seconds(), "flash_attn4_kernel_cache": str(cache) if cache else None,
           "flash_attn4_cached_files": sum(1 for f in cache.rglob("*") if f.is_file()) if cache and cache.exists() else 0,
           "shapes": rows}
    if report:
        write_atomic(Path(report), json.dumps(doc, indent=1))
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0
    con = Console(width=160)
    t = Table(title="attnkit warmup" + (" (dry run: nothing compiled)" if dry_run else ""))
    for col in ("shape", "backend", "first call s", "second call s"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["shape"], str(r["backend"]), str(r["first_call_s"] or "-"), str(r["second_call_s"] or "-"))
    con.print(t)
    con.print(f"FlashAttention-4 kernel cache: {doc['flash_attn4_kernel_cache'] or 'off'} "
              f"({doc['flash_attn4_cached_files']} files); total {doc['total_s']} s")
    return 0


def _planned(s: WarmupShape, p: Any) -> str:
    """The backend selection would choose for this shape on this machine (no tensors, nothing compiled)."""
    from attnkit.runtime.call import AttentionCall, normalise_mask
    from attnkit.runtime.select import NoBackendError, select

    sq, sk = s.sizes()
    device = "cuda" if p.has_gpu else "cpu"
    causal, window = normalise_mask(s.causal, sq, s.window)
    call = AttentionCall(device=device, device_index=0, dtype=s.dtype, batch=len(s.lengths) if s.lengths else s.batch,
                         seqlen_q=sq, seqlen_k=sk, heads=s.heads, kv_heads=s.kv_heads or s.heads, head_dim=s.head_dim,
                         head_dim_v=s.head_dim, causal=causal, dropout=False, window=window, alibi=False, bias=False,
                         varlen=s.lengths is not None, requires_grad=s.train, softcap=s.softcap > 0,
                         lengths_q=s.lengths, lengths_k=s.lengths)
    try:
        return select(call, p).name
    except NoBackendError as exc:
        return f"none ({str(exc).splitlines()[0]})"
