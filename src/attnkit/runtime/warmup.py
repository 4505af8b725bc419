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
import math
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from attnkit.errors import AttnkitError
from attnkit.runtime.call import MAX_FACTOR
from attnkit.runtime.call import MAX_LEN as INT_MAX  # attention()'s own bound for sizes, lengths, windows
from attnkit.runtime.shape import Shape, make_inputs

DTYPES = ("float16", "bfloat16")


FULL_KINDS = {"attention": "full_attention", "chunked_attention": "full_attention"}  # layer_types spellings
# strict: JSON `true` is not 1 head, 2.5 is not a length
Count = Annotated[int, Strict(), Field(ge=1, le=INT_MAX)]


class WarmupShape(BaseModel):
    """One attention call to compile for: the JSON file is a list of these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str = ""
    batch: Count = 1
    seqlen: Count | None = Field(None, description="queries = keys (self-attention)")
    seqlen_q: Count | None = None
    seqlen_k: Count | None = None
    heads: Count
    kv_heads: Count | None = None
    head_dim: Count
    dtype: Literal["float16", "bfloat16"] = "bfloat16"
    causal: Annotated[bool, Strict()] = True
    window: tuple[Annotated[int, Strict(), Field(le=INT_MAX)], Annotated[int, Strict(), Field(le=INT_MAX)]] | None = None
    softcap: Annotated[float, Strict(), Field(ge=0, le=MAX_FACTOR, allow_inf_nan=False)] = 0.0
    alibi: Annotated[bool, Strict()] = Field(False, description="ALiBi (flex compiles a kernel for it)")
    lengths: tuple[Count, ...] | None = Field(None, description="packed varlen: per-sequence lengths")
    train: Annotated[bool, Strict()] = True

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

    def shape(self) -> Shape:
        """The call as the one call-spec type (runtime/shape.py), whose tensors every harness builds alike."""
        sq, sk = self.sizes()
        return Shape(self.name(), self.batch if self.lengths is None else len(self.lengths), self.heads,
                     self.kv_heads or self.heads, sq, sk, self.head_dim, self.dtype, self.causal, self.window,
                     self.lengths, self.train, self.alibi, self.softcap)

    def name(self) -> str:
        sq, sk = self.sizes()
        kind = "varlen" if self.lengths else f"Sq={sq} Sk={sk}"
        return self.label or (f"{self.dtype} B={self.batch} {kind} H={self.heads}/{self.kv_heads or self.heads} "
                              f"D={self.head_dim}{' causal' if self.causal else ''}"
                              f"{f' window={self.window}' if self.window else ''}{' alibi' if self.alibi else ''}"
                              f"{' train' if self.train else ''}")


def _read_json(option: str, path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AttnkitError(f"{option} {path}: cannot read ({exc.strerror})") from None
    except RecursionError:
        raise AttnkitError(f"{option} {path}: not JSON this program reads (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise AttnkitError(f"{option} {path}: not JSON ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def _validation_message(exc: ValidationError) -> str:
    """'heads: Input should be greater than or equal to 1 (got 0)': pydantic's first error, on one line."""
    e = exc.errors(include_url=False)[0]
    where = "".join(f"{x}: " for x in e["loc"])
    got = f" (got {e['input']!r})" if e["type"] != "value_error" and not isinstance(e.get("input"), dict) else ""
    return " ".join(f"{where}{e['msg'].removeprefix('Value error, ')}{got}"[:400].split())


def load_shapes(path: str) -> list[WarmupShape]:
    """A JSON list of shapes; one-line errors that name the file, the entry and the field."""
    data = _read_json("--shapes", Path(path))
    if not isinstance(data, list) or not data:
        raise AttnkitError(f"--shapes {path}: expected a non-empty JSON list of shapes (objects with heads, "
                           f"head_dim, seqlen, ...), got {type(data).__name__}{' (empty)' if data == [] else ''}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise AttnkitError(f"--shapes {path}: entry {i}: expected an object with heads, head_dim, seqlen, ..., "
                               f"got {type(item).__name__}")
        try:
            out.append(WarmupShape.model_validate(item))
        except ValidationError as exc:
            raise AttnkitError(f"--shapes {path}: entry {i}: {_validation_message(exc)}") from None
    return out


def _config_int(cfg_path: Path, cfg: dict[str, Any], key: str, required: bool = True) -> int | None:
    """A count from a model config: a JSON integer >= 1 (not true, not 2.5, not "32"); None when absent or null
    and not required."""
    value = cfg.get(key)
    if value is None and not required:
        return None
    if value is None:
        raise AttnkitError(f"--model {cfg_path}: needs num_attention_heads and head_dim or hidden_size ({key} is "
                           "missing; an integer >= 1)")
    if type(value) is not int or not 1 <= value <= INT_MAX:
        raise AttnkitError(f"--model {cfg_path}: {key}: expected an integer from 1 to {INT_MAX}, got {value!r}"[:300])
    return value


def shapes_from_model(path: str, seqlen: int, batch: int, dtype: str | None) -> list[WarmupShape]:
    """The attention calls of a Hugging Face model (config.json, or the folder holding it): a training step
    at `seqlen`, a prefill and a decode step against a `seqlen` cache; sliding-window and softcap settings
    (Mistral, Gemma 2/3, Qwen) and ALiBi (BLOOM, MPT, Falcon-RW) carried over."""
    for option, value in (("--seqlen", seqlen), ("--batch", batch)):
        if type(value) is not int or value < 1:
            raise AttnkitError(f"{option}: expected an integer >= 1, got {value!r}")
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    raw = _read_json("--model", cfg_path)
    if not isinstance(raw, dict):
        raise AttnkitError(f"--model {cfg_path}: expected a JSON object (a Hugging Face config.json), "
                           f"got {type(raw).__name__}")
    text_config = raw.get("text_config", {})
    if not isinstance(text_config, dict):  # multimodal configs keep the language model's here
        raise AttnkitError(f"--model {cfg_path}: text_config: expected an object (the language model's config), "
                           f"got {'null' if text_config is None else type(text_config).__name__}")
    cfg: dict[str, Any] = {**raw, **text_config}
    for alias, key in (("n_head", "num_attention_heads"), ("n_heads", "num_attention_heads"),
                       ("n_embed", "hidden_size"), ("d_model", "hidden_size")):  # BLOOM, MPT, older Falcon names
        if key not in cfg and alias in cfg:
            cfg[key] = cfg[alias]
    heads = _config_int(cfg_path, cfg, "num_attention_heads")
    assert heads is not None
    kv = _config_int(cfg_path, cfg, "num_key_value_heads", required=False) or heads
    if heads % kv:
        raise AttnkitError(f"--model {cfg_path}: num_key_value_heads: {kv} does not divide num_attention_heads "
                           f"{heads}; allowed: a divisor of it")
    head_dim = _config_int(cfg_path, cfg, "head_dim", required=False)
    if head_dim is None:
        if cfg.get("hidden_size") is None:
            raise AttnkitError(f"--model {cfg_path}: needs num_attention_heads and head_dim or hidden_size (both "
                               "head_dim and hidden_size are missing; integers >= 1)")
        hidden = _config_int(cfg_path, cfg, "hidden_size")
        assert hidden is not None
        if hidden % heads:
            raise AttnkitError(f"--model {cfg_path}: hidden_size {hidden} is not a multiple of num_attention_heads "
                               f"{heads}; give head_dim")
        head_dim = hidden // heads
    dt = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dt not in DTYPES:
        dt = "bfloat16"
    softcap_raw = cfg.get("attn_logit_softcapping")
    if softcap_raw is None:
        softcap = 0.0
    elif type(softcap_raw) not in (int, float) or not math.isfinite(softcap_raw) or not 0 <= softcap_raw <= MAX_FACTOR:
        raise AttnkitError(f"--model {cfg_path}: attn_logit_softcapping: expected a number from 0 to {MAX_FACTOR:g} (or null), "
                           f"got {softcap_raw!r}"[:300])
    else:
        softcap = float(softcap_raw)
    use_sw = cfg.get("use_sliding_window", True)
    sw = cfg.get("sliding_window") if use_sw is not False and use_sw is not None else None
    if sw is not None and (type(sw) is not int or not 0 <= sw <= INT_MAX):
        raise AttnkitError(f"--model {cfg_path}: sliding_window: expected an integer >= 1 (tokens), or null or 0 for "
                           f"none, got {sw!r}"[:300])
    # ALiBi models: BLOOM (model_type "bloom"), MPT (attn_config.alibi), Falcon-RW (alibi: true)
    attn_cfg: dict[str, Any] = cfg["attn_config"] if isinstance(cfg.get("attn_config"), dict) else {}
    alibi = cfg.get("model_type") == "bloom" or cfg.get("alibi") is True or attn_cfg.get("alibi") is True
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise AttnkitError(f"--model {cfg_path}: layer_types: expected a list of layer kinds, got "
                           f"{type(layer_types).__name__}")
    # Granite 4 hybrids say "attention" (beside "mamba"); Llama 4's chunked layers warm as full attention, as
    # they did before layer_types was read; linear and state-space layers make no attention call
    layer_types = [FULL_KINDS.get(t, t) if isinstance(t, str) else t for t in layer_types]
    if layer_types and not any(t in ("full_attention", "sliding_attention") for t in layer_types):
        raise AttnkitError(f"--model {cfg_path}: layer_types: no attention layer ('full_attention', "
                           f"'sliding_attention', 'attention', 'chunked_attention') in {layer_types[:4]!r}"[:300])
    windows: list[tuple[int, int] | None] = []
    if sw and (not layer_types or "sliding_attention" in layer_types):
        windows.append((sw - 1, 0))  # HF's window counts the query itself, as flash-attn's left + 1
    if not sw or "full_attention" in layer_types:
        windows.append(None)
    out = []
    name = cfg_path.parent.name or "model"
    for w in windows:
        tag = f" window {w[0] + 1}" if w else ""
        try:
            base = WarmupShape.model_validate({"heads": heads, "kv_heads": kv, "head_dim": head_dim, "dtype": dt,
                                               "window": w, "softcap": softcap, "batch": batch, "seqlen": seqlen,
                                               "alibi": alibi})
        except ValidationError as exc:  # the checks above should leave nothing; still one line, never a traceback
            raise AttnkitError(f"--model {cfg_path}: {_validation_message(exc)}") from None
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

    t = make_inputs(s.shape(), device, requires_grad=s.train)  # the values do not change what compiles
    q, k, v, kw = t.q, t.k, t.v, t.kw
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
