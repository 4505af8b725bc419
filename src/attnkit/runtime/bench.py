"""`attnkit bench`: attnkit against the calls a user would otherwise write, side by side in one process.

Candidates per shape:
- `sdpa_plain`: F.scaled_dot_product_attention as a user writes it: no context manager, `enable_gqa` for GQA,
  `causal_lower_right` for causal with fewer queries than keys, a mask built once (outside the timing) for a
  sliding window, and for packed varlen the padded batch with its padding mask (what one does without a
  varlen kernel).
- each library's own function called directly: `flash_attn4` (flash_attn.cute), `flash_attn2`, `xformers`,
  when installed and able to serve the shape;
- `attnkit:<backend>`: attention() forced to each backend that can serve the shape;
- `attnkit`: attention() choosing for itself.
Two timing modes, both on the host's clock: `sync` (one call, then a device sync: latency, host cost counts)
and `b2b` (N calls back to back, then one sync: throughput, host cost hides behind kernels that are long
enough). Candidates are interleaved in a fresh random order every iteration (the H200's clocks drift within
seconds). Every candidate's output is checked against a float32 reference on sampled rows; one that is wrong
is reported and cannot be the oracle (the fastest correct candidate).
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnkit._io import write_atomic
from attnkit.errors import first_line
from attnkit.runtime import table

PLAIN = "sdpa_plain"
AUTO = "attnkit"
LIBRARIES = ("flash_attn4", "flash_attn2", "xformers", "flex")  # library functions called directly, when installed
MATH_MAX_SCORES = 1 << 26  # sdpa_math materialises B*H*Sq*Sk scores: bench it only where that is small
REF_ROWS = 256  # query rows checked per (sequence, head) against the float32 reference
# forward max abs error allowed against the float32 reference (2x the smoke's float64 tolerance)
BENCH_TOL = {"float16": 8e-3, "bfloat16": 5e-2, "float32": 4e-4}
TARGET_ORACLE = 0.97
TARGET_PLAIN = 0.98


@dataclass(frozen=True)
class Shape:
    label: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = True
    window: tuple[int, int] | None = None
    lengths: tuple[int, ...] | None = None  # packed varlen self-attention: the sequences' lengths
    train: bool = True  # forward+backward timed too
    alibi: bool = False  # ALiBi with the usual geometric slopes (2^(-8 h / heads))
    softcap: float = 0.0


def _varlen(label: str, lengths: tuple[int, ...], heads: int, kv_heads: int, d: int, **kw: Any) -> Shape:
    return Shape(label, len(lengths), heads, kv_heads, max(lengths), max(lengths), d, lengths=lengths, **kw)


def _lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    out = [rng.randint(lo, hi) for _ in range(n)]
    out[0] = hi
    return tuple(out)


def suite(quick: bool) -> list[Shape]:
    """The GPU suite covers every call class the selection distinguishes; the quick one is a CPU sanity run."""
    if quick:
        return [Shape("tiny train fp32", 2, 4, 4, 128, 128, 64, "float32"),
                Shape("tiny GQA fp32", 2, 8, 2, 128, 128, 64, "float32", causal=False),
                Shape("tiny decode fp32", 4, 8, 2, 1, 256, 64, "float32", train=False),
                Shape("tiny prefill fp32", 2, 4, 4, 32, 128, 64, "float32", train=False),
                Shape("tiny window fp32", 2, 4, 4, 128, 128, 64, "float32", window=(16, 0)),
                _varlen("tiny varlen fp32", (100, 7, 60, 1), 4, 2, 32, dtype="float32")]
    return [
        # training, MHA / GQA, head dims 64-256, fp16 / bf16 / fp32, causal and not
        Shape("train MHA D128 S4096", 8, 16, 16, 4096, 4096, 128, causal=False),
        Shape("train MHA D128 S4096 causal", 8, 16, 16, 4096, 4096, 128),
        Shape("train GQA 32/8 D128 S4096 causal", 8, 32, 8, 4096, 4096, 128),
        Shape("train GQA 32/8 D128 S8192 causal", 2, 32, 8, 8192, 8192, 128),
        Shape("train MHA D128 S16384 causal", 1, 32, 32, 16384, 16384, 128),
        Shape("train fp16 D128 S2048 causal", 8, 16, 16, 2048, 2048, 128, "float16"),
        Shape("train D64 S1024 causal", 32, 32, 32, 1024, 1024, 64),
        Shape("train fp16 D64 S2048", 16, 16, 16, 2048, 2048, 64, "float16", causal=False),
        Shape("train D96 S2048 causal", 8, 16, 16, 2048, 2048, 96),
        Shape("train D256 S2048 causal", 4, 16, 16, 2048, 2048, 256),
        Shape("train fp32 D64 S2048 causal", 4, 16, 16, 2048, 2048, 64, "float32"),
        Shape("train fp32 GQA 16/4 D128 S1024", 4, 16, 4, 1024, 1024, 128, "float32", causal=False),
        # decode: one query (and speculative decoding's few) against a KV cache
        Shape("decode GQA 32/8 D128 Sk4096", 64, 32, 8, 1, 4096, 128, train=False),
        Shape("decode GQA 32/4 D128 Sk32768", 4, 32, 4, 1, 32768, 128, train=False),
        Shape("decode fp16 MHA D64 Sk1024", 128, 16, 16, 1, 1024, 64, "float16", train=False),
        Shape("spec-decode Sq4 Sk4096 GQA 32/8", 16, 32, 8, 4, 4096, 128, train=False),
        # small batch x short sequence: launch and host time decide
        Shape("small fp16 B1 S128 D64 causal", 1, 8, 8, 128, 128, 64, "float16"),
        Shape("small B4 S256 D64 causal", 4, 16, 16, 256, 256, 64, train=False),
        Shape("small fp16 B64 S256 D64", 64, 16, 16, 256, 256, 64, "float16", causal=False, train=False),
        # chunked prefill: fewer queries than keys, bottom-right causal
        Shape("prefill Sq512 Sk4096 GQA 32/8 D128", 4, 32, 8, 512, 4096, 128, train=False),
        Shape("prefill Sq2048 Sk8192 D128", 2, 16, 16, 2048, 8192, 128),
        # sliding window
        Shape("window 1024 S4096 D128 causal", 4, 16, 16, 4096, 4096, 128, window=(1024, 0)),
        Shape("window 4096 GQA 32/8 S16384 causal", 1, 32, 8, 16384, 16384, 128, window=(4096, 0)),
        Shape("window 256+256 S2048 D64", 8, 16, 16, 2048, 2048, 64, causal=False, window=(256, 256), train=False),
        # packed varlen with mixed lengths, very short ones included
        _varlen("varlen GQA 32/8 D128 17-4096 causal", _lengths(16, 17, 4096, 0), 32, 8, 128),
        _varlen("varlen short 1-64 x256 D64 causal", _lengths(256, 1, 64, 1), 16, 16, 64, train=False),
        # cross-attention: more queries than keys
        Shape("cross Sq4096 Sk512 D64", 8, 16, 16, 4096, 512, 64, causal=False),
        Shape("cross fp16 Sq1024 Sk77 D64", 16, 8, 8, 1024, 77, 64, "float16", causal=False, train=False),
    ]


def attn_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs (two matmuls); causal counts only the visible half when sq == sk."""
    f = 4.0 * batch * heads * sq * sk * d
    if causal and sq == sk:
        f /= 2
    return f


# -- timing -----------------------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def warm(runs: dict[str, Callable[[], Any]], device: str, times: int = 2) -> tuple[dict[str, Any], dict[str, str]]:
    """Call each candidate `times` times (JIT compiles happen here, never inside a timed sample); returns the
    first output of each and the error of each candidate that raised (a result, not a crash)."""
    outs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, fn in runs.items():
        try:
            for i in range(times):
                out = fn()
                if i == 0:
                    outs[name] = out
            _sync(device)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {first_line(exc)}"
            _sync(device)
    return outs, errors


def interleaved(runs: dict[str, Callable[[], Any]], device: str, iters: int, calls: int = 1,
                seed: int = 0) -> dict[str, float]:
    """Median seconds per call of each candidate, on the host's clock, `calls` calls then one device sync per
    sample (calls=1: latency; calls=N: back-to-back throughput). Every iteration times every candidate once,
    in a fresh random order: a rotation would keep each candidate behind the same predecessor, and a kernel
    that runs right after a slow, low-power one gets the power headroom (measured on the H200: 604 vs 540
    TFLOP/s for one cuDNN kernel, 2026-11-30)."""
    samples: dict[str, list[float]] = {n: [] for n in runs}
    order = list(runs)
    shuffle = random.Random(seed).shuffle
    for _ in range(iters):
        shuffle(order)
        for n in order:
            fn = runs[n]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            samples[n].append((time.perf_counter() - t0) / calls)
    return {n: statistics.median(v) for n, v in samples.items()}


# -- the candidates ---------------------------------------------------------------------------------------------

class Case:
    """One shape's tensors and every candidate's call, built once outside the timing."""

    def __init__(self, s: Shape, device: str) -> None:
        import torch

        from attnkit.runtime.call import Inputs

        self.s, self.device = s, device
        dt = getattr(torch, s.dtype)
        gen = torch.Generator(device=device).manual_seed(0)

        def r(*shape: int) -> Any:
            return torch.randn(*shape, generator=gen, device=device, dtype=dt)

        kw: dict[str, Any] = {"causal": s.causal, "window": s.window}
        self.slopes = None
        if s.alibi:
            self.slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / s.heads) for h in range(s.heads)], device=device)
            kw["alibi_slopes"] = self.slopes
        if s.softcap:
            kw["softcap"] = s.softcap
        if s.lengths is not None:
            total = sum(s.lengths)
            self.q, self.k, self.v = r(total, s.heads, s.head_dim), r(total, s.kv_heads, s.head_dim), \
                r(total, s.kv_heads, s.head_dim)
            self.cu = torch.tensor([0, *itertools.accumulate(s.lengths)], dtype=torch.int32, device=device)
            kw.update(cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, max_seqlen_q=max(s.lengths),
                      max_seqlen_k=max(s.lengths))
        else:
            self.q = r(s.batch, s.seqlen_q, s.heads, s.head_dim)
            self.k = r(s.batch, s.seqlen_k, s.kv_heads, s.head_dim)
            self.v = r(s.batch, s.seqlen_k, s.kv_heads, s.head_dim)
            self.cu = None
        self.kw = kw
        self.inputs = Inputs(self.q, self.k, self.v, **kw)
        self.grad_out = torch.randn((*self.q.shape[:-1], s.head_dim), generator=gen, device=device, dtype=dt)
        self._plain: Callable[[Any, Any, Any], Any] = self._make_plain()

    def call(self, grad: bool) -> Any:
        import torch

        with torch.set_grad_enabled(grad):
            for t in (self.q, self.k, self.v, *getattr(self, "padded", ())):
                t.requires_grad_(grad)
            return self.inputs.describe()

    def _make_plain(self) -> Callable[[Any, Any, Any], Any]:
        """The plain SDPA call a user writes for this shape (mask or padding built once, here)."""
        import torch
        import torch.nn.functional as F

        from attnkit.runtime import layout

        s = self.s
        kw: dict[str, Any] = {"enable_gqa": s.heads != s.kv_heads} if s.heads != s.kv_heads else {}
        if s.lengths is not None:  # the padded batch with a key-padding (and causal) mask, built once
            n, m = len(s.lengths), max(s.lengths)
            lengths = torch.tensor(s.lengths, device=self.device)
            idx = layout.varlen_indices(self.cu, m)
            self.padded = [layout.unpack(t, idx, n, m).detach() for t in (self.q, self.k, self.v)]
            mask = layout.allowed_mask(m, m, causal=s.causal, window=s.window, device=self.device,
                                       lengths_q=lengths, lengths_k=lengths)
            kw["attn_mask"] = layout.safe_rows(mask)[0]
            self.padded_grad = layout.unpack(self.grad_out, idx, n, m)
        elif s.window is not None:
            kw["attn_mask"] = layout.allowed_mask(s.seqlen_q, s.seqlen_k, causal=s.causal, window=s.window,
                                                  device=self.device)
        elif s.causal and s.seqlen_q == s.seqlen_k:
            kw["is_causal"] = True
        elif s.causal and s.seqlen_q > 1:
            from torch.nn.attention.bias import causal_lower_right

            kw["attn_mask"] = causal_lower_right(s.seqlen_q, s.seqlen_k)
        if s.alibi or s.softcap:  # a bias (ALiBi, and the mask) built once, in q's dtype, as a user writes it
            bias = _plain_bias(s, self.slopes, kw.pop("attn_mask", None), kw.pop("is_causal", False), self.device,
                               self.q.dtype)
            if bias is not None:
                kw["attn_mask"] = bias
        sdpa = F.scaled_dot_product_attention
        if s.softcap:  # SDPA has no softcap: the math written out
            sdpa = functools.partial(layout.eager_sdpa, softcap=s.softcap)
        return lambda q, k, v: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)

    def candidates(self, grad: bool) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
        """name -> a no-argument call (its output, for the check); and name -> why a candidate is absent."""
        from attnkit.runtime.attention import attention
        from attnkit.runtime.backends import REGISTRY
        from attnkit.runtime.probe import probe

        call = self.call(grad)
        p = probe()
        q, k, v, kw = self.q, self.k, self.v, self.kw
        runs: dict[str, Callable[[], Any]] = {}
        absent: dict[str, str] = {}
        if self.s.lengths is not None:
            pq, pk, pv = self.padded
            runs[PLAIN] = lambda: self._plain(pq, pk, pv)
        else:
            runs[PLAIN] = lambda: self._plain(q, k, v)
        for lib in LIBRARIES:
            why = REGISTRY[lib].check(call, p)
            direct = None if why else _library_call(lib, self)
            if direct is None:
                absent[lib] = "; ".join(why) or "no direct call for this shape"
            else:
                runs[lib] = direct
        scores = call.batch * call.heads * call.seqlen_q * call.seqlen_k
        for name, b in REGISTRY.items():
            why = b.check(call, p)
            if name == "sdpa_math" and scores > MATH_MAX_SCORES:
                why = [*why, "reference kernel: materialises the score matrix, too large to bench here"]
            if why:
                absent[f"attnkit:{name}"] = "; ".join(why)
            else:
                def forced(name: str = name) -> Any:
                    return attention(q, k, v, backend=name, **kw)
                runs[f"attnkit:{name}"] = forced
        runs[AUTO] = lambda: attention(q, k, v, **kw)
        return runs, absent

    def step(self, fn: Callable[[], Any], name: str) -> Callable[[], Any]:
        """Forward + backward with this case's output gradient."""
        g = self.padded_grad if (name == PLAIN and self.s.lengths is not None) else self.grad_out
        tensors = self.padded if (name == PLAIN and self.s.lengths is not None) else (self.q, self.k, self.v)

        def run() -> Any:
            for t in tensors:
                t.grad = None
            out = fn()
            out.backward(g)
            return out
        return run


def _plain_bias(s: Shape, slopes: Any, mask: Any, causal: bool, device: str, dtype: Any) -> Any:
    """The additive bias a user builds once for SDPA: -slope * |j - i - (Sk - Sq)|, -inf where the mask (or
    bottom-right causal) rules a key out; None when there is nothing to add."""
    import torch

    from attnkit.runtime import layout

    if mask is not None and not isinstance(mask, torch.Tensor):  # a causal_lower_right object: its dense form
        mask = layout.allowed_mask(s.seqlen_q, s.seqlen_k, causal=True, window=None, device=device)
    if mask is None and causal:
        mask = layout.allowed_mask(s.seqlen_q, s.seqlen_k, causal=True, window=None, device=device)
    if slopes is None:
        return mask
    if s.lengths is not None:  # padded varlen: per-sequence diagonals are all at i (self-attention)
        sq = sk = max(s.lengths)
    else:
        sq, sk = s.seqlen_q, s.seqlen_k
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    bias = -slopes[:, None, None] * (j - i - (sk - sq)).abs()[None].float()
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    return bias.to(dtype)


def _library_call(lib: str, c: Case) -> Callable[[], Any] | None:
    """The library's own function, called as its documentation shows; None where it has no direct form."""
    s, q, k, v = c.s, c.q, c.k, c.v
    scale = 1.0 / math.sqrt(s.head_dim)
    if lib == "flash_attn4":
        from attnkit.runtime.loaders import load_fa4 as load

        fa = load()
        kw: dict[str, Any] = {"causal": s.causal}
        if s.window is not None:
            kw["window_size"] = tuple(None if w < 0 else w for w in s.window)
        if s.softcap:
            kw["softcap"] = s.softcap
        if s.lengths is not None:
            m = max(s.lengths)
            return lambda: _first(fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=c.cu, cu_seqlens_k=c.cu,
                                                            max_seqlen_q=m, max_seqlen_k=m, **kw))
        return lambda: _first(fa.flash_attn_func(q, k, v, **kw))
    if lib == "flex":  # torch's FlexAttention as its documentation shows: compiled once, a block mask built once
        if s.lengths is not None:
            return None
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        off, win, slopes = s.seqlen_k - s.seqlen_q, s.window, c.slopes

        def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
            ok = j <= i + off if s.causal else j >= 0
            if win is not None and win[0] >= 0:
                ok = ok & (j >= i + off - win[0])
            if win is not None and win[1] >= 0:
                ok = ok & (j <= i + off + win[1])
            return ok

        def score_mod(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
            if s.softcap:
                score = s.softcap * torch.tanh(score / s.softcap)
            if slopes is not None:
                score = score - slopes[h] * (j - i - off).abs()
            return score
        masked = s.causal or win is not None
        block = create_block_mask(mask_mod, None, None, s.seqlen_q, s.seqlen_k, device=c.device) if masked else None
        fn = torch.compile(flex_attention) if c.device == "cuda" else flex_attention
        mod = score_mod if (s.softcap or slopes is not None) else None
        gqa = s.heads != s.kv_heads
        return lambda: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=mod, block_mask=block,
                          enable_gqa=gqa).transpose(1, 2)
    if lib == "flash_attn2":
        import flash_attn

        kw = {"causal": s.causal, "window_size": s.window or (-1, -1), "softmax_scale": scale,
              "softcap": s.softcap, "alibi_slopes": c.slopes}
        if s.lengths is not None:
            m = max(s.lengths)
            return lambda: flash_attn.flash_attn_varlen_func(q, k, v, c.cu, c.cu, m, m, **kw)
        return lambda: flash_attn.flash_attn_func(q, k, v, **kw)
    if lib == "xformers":
        if s.window is not None or s.heads != s.kv_heads or s.alibi or s.softcap:
            return None  # no bias class for our windows, ALiBi or softcap; GQA needs its 5-D form
        from attnkit.runtime.loaders import load_fmha

        fmha = load_fmha()
        if s.lengths is not None:
            bd = fmha.attn_bias.BlockDiagonalMask.from_seqlens(list(s.lengths))
            bias = bd.make_causal_from_bottomright() if s.causal else bd
            return lambda: fmha.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias)[0]
        bias = fmha.attn_bias.LowerTriangularFromBottomRightMask() if s.causal else None
        return lambda: fmha.memory_efficient_attention(q, k, v, attn_bias=bias)
    return None


def _first(out: Any) -> Any:
    return out[0] if type(out) is tuple else out


# -- the numerics check ----------------------------------------------------------------------------------------

def max_error(c: Case, out: Any, name: str) -> float:
    """Max abs error of a candidate's output against a float32 reference, on sampled query rows of the first
    and last sequence and of the first and last head."""
    import torch

    from attnkit.runtime import layout

    s = c.s
    groups = s.heads // s.kv_heads
    worst = 0.0
    seqs = [0, len(s.lengths) - 1] if s.lengths is not None else [0, s.batch - 1]
    for b in dict.fromkeys(seqs):
        if s.lengths is not None:
            lo, n = sum(s.lengths[:b]), s.lengths[b]
            q, k, v = c.q[lo:lo + n], c.k[lo:lo + n], c.v[lo:lo + n]
            got = out[b, :n] if (name == PLAIN) else out[lo:lo + n]
            sq = sk = n
        else:
            q, k, v, got = c.q[b], c.k[b], c.v[b], out[b]
            sq, sk = s.seqlen_q, s.seqlen_k
        rows = torch.unique(torch.linspace(0, sq - 1, min(sq, REF_ROWS), device=c.device).long())
        ok = layout.allowed_mask(sq, sk, causal=s.causal, window=s.window, device=c.device)[0, 0][rows]
        for h in dict.fromkeys([0, s.heads - 1]):
            scores = (q[rows, h].float() @ k[:, h // groups].float().T) / math.sqrt(s.head_dim)
            if s.softcap:
                scores = s.softcap * torch.tanh(scores / s.softcap)
            if c.slopes is not None:
                j = torch.arange(sk, device=c.device)[None, :]
                scores = scores - c.slopes[h] * (j - rows[:, None] - (sk - sq)).abs().float()
            scores = scores.masked_fill(~ok, float("-inf"))
            p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see no key: zeros
            ref = p @ v[:, h // groups].float()
            worst = max(worst, (got[rows, h].float() - ref).abs().max().item())
    return worst


# -- one shape --------------------------------------------------------------------------------------------------

def bench_shape(s: Shape, device: str, iters: int = 15, rounds: int = 5) -> dict[str, Any]:
    import torch

    from attnkit.runtime.priority import order_for
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import select

    c = Case(s, device)
    p = probe()
    out: dict[str, Any] = {"label": s.label, "shape": asdict(s), "ms": {}, "errors": {}, "absent": {},
                           "max_err": {}, "wrong": {}, "selected_by_pass": {}, "row": {}}
    passes = ["fwd", "fwdbwd"] if s.train else ["fwd"]
    for ps in passes:
        grad = ps == "fwdbwd"
        call = c.call(grad)
        if ps == passes[-1]:
            out["call"] = call.describe()
        chosen = select(call, p).name
        row = order_for(call, p.capability(call.device_index) if device == "cuda" else None)[1]
        out["selected_by_pass"][ps] = chosen
        out.setdefault("cell", {})[ps] = table.cell_of(call)
        out["row"][ps] = row.describe()
        runs, absent = c.candidates(grad)
        out["absent"].update(absent)
        if grad:
            runs = {n: c.step(fn, n) for n, fn in runs.items()}
        with torch.set_grad_enabled(grad):
            first, errors = warm(runs, device)
            for n, err in errors.items():
                out["errors"][f"{n} {ps}"] = err
                runs.pop(n)
            if not grad:  # numerics: forward outputs against the reference
                tol = BENCH_TOL.get(s.dtype, 1e-3)
                for n, o in first.items():
                    e = max_error(c, o.detach(), n)
                    out["max_err"][n] = e
                    if not e <= tol:
                        out["wrong"][n] = f"forward max error {e:.3g} > {tol}"
            runs = {n: fn for n, fn in runs.items() if n not in out["wrong"]}
            t_one = interleaved(runs, device, iters=2)
            calls = max(3, min(200, int(4e-3 / max(1e-6, min(t_one.values())))))
            sync = interleaved(runs, device, iters=iters, seed=1)
            b2b = interleaved(runs, device, iters=rounds, calls=calls, seed=2)
        for n in runs:
            out["ms"].setdefault(n, {})[ps] = {"sync": sync[n] * 1e3, "b2b": b2b[n] * 1e3}
        out.setdefault("b2b_calls", {})[ps] = calls
    out["selected"] = out["selected_by_pass"][passes[-1]]
    out["head_dim"] = s.head_dim
    out["log2_work"] = round(table.log2_work(call), 3)
    flops = attn_flops(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal)
    out["flops_fwd"] = flops
    out["fa4_or_varlen"] = s.lengths is not None or "flash_attn4" in out["ms"]
    out["ratios"] = ratios(out["ms"], passes)
    return out


def ratios(ms: dict[str, dict[str, dict[str, float]]], passes: list[str]) -> dict[str, Any]:
    """Per pass and mode: attnkit's speed relative to the oracle (fastest correct candidate) and to the plain
    SDPA call (>1 = attnkit faster)."""
    res: dict[str, Any] = {}
    for ps in passes:
        for mode in ("sync", "b2b"):
            t = {n: v[ps][mode] for n, v in ms.items() if ps in v}
            if AUTO not in t:
                continue
            oracle = min(t, key=lambda n: t[n])
            r: dict[str, Any] = {"oracle": oracle, "selected_over_oracle": t[oracle] / t[AUTO]}
            if PLAIN in t:
                r["selected_over_sdpa_plain"] = t[PLAIN] / t[AUTO]
            res.setdefault(ps, {})[mode] = r
    return res


# -- dispatch overhead -------------------------------------------------------------------------------------------

def dispatch_overhead(device: str, n: int = 2000) -> dict[str, Any]:
    """Host microseconds attention() adds per call over the plain SDPA call a user writes, on a tiny shape
    (so no kernel hides host time): blocks of back-to-back calls, alternated, median difference."""
    import torch
    import torch.nn.functional as F

    from attnkit.runtime import dispatch
    from attnkit.runtime.attention import attention

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 16, 2, 64, device=device, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)

    def loop(fn: Callable[[], Any], calls: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / calls * 1e6

    def plain() -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def via() -> Any:
        return attention(q, k, v, causal=True)

    with torch.no_grad():
        bound = dispatch.bind(q, k, v, causal=True)

        def via_bound() -> Any:  # attnkit.bind(): the call fixed once, no key built per call
            return bound(q, k, v)

        via()
        backend = next(b.backend.name for b in dispatch.bound_calls() if b.call.batch == q.shape[0]
                       and b.call.seqlen_q == q.shape[1] and b.call.heads == q.shape[2])
        loop(plain, 200)
        loop(via, 200)
        rounds = []
        block = max(50, n // 10)
        for i in range(21):  # short alternating blocks, order flipped each round; median difference
            if i % 2 == 0:
                a, b = loop(plain, block), loop(via, block)
            else:
                b, a = loop(via, block), loop(plain, block)
            rounds.append((b - a, a, b))
        bound_rounds = []
        for i in range(21):  # the same for the bound runner
            if i % 2 == 0:
                a, b = loop(plain, block), loop(via_bound, block)
            else:
                b, a = loop(via_bound, block), loop(plain, block)
            bound_rounds.append(b - a)
        # attention() alone: its cached runner swapped for a no-op (host cost of the lookup only)
        with dispatch.runners_replaced(lambda q, k, v: None):
            wrapper_us = min(loop(via, n) for _ in range(5))
    rounds.sort()
    mid = rounds[len(rounds) // 2]
    bound_rounds.sort()
    return {"backend": backend, "overhead_us": mid[0], "plain_us": mid[1], "attention_us": mid[2],
            "bound_overhead_us": bound_rounds[len(bound_rounds) // 2], "bound_backend": bound.backend.name,
            "wrapper_only_us": wrapper_us, "calls_per_block": block, "rounds": len(rounds)}


# -- the run ------------------------------------------------------------------------------------------------------

def warm_gpu(seconds: float = 3.0) -> None:
    """Run matmuls until clocks settle, so the first shapes are not measured on a cold GPU."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    from attnkit.runtime.probe import probe

    p = probe()
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "probe": p.to_dict()}


def summarize(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """Minimums, the geometric mean over FA4/varlen shapes, and every shape below a target with its numbers."""
    summary: dict[str, Any] = {"targets": {"selected_over_oracle": TARGET_ORACLE,
                                           "selected_over_sdpa_plain": TARGET_PLAIN}}
    below: list[dict[str, Any]] = []
    for ps in ("fwd", "fwdbwd"):
        for mode in ("sync", "b2b"):
            rows = [(sh["label"], sh["ratios"][ps][mode]) for sh in shapes if ps in sh["ratios"]
                    and mode in sh["ratios"][ps]]
            if not rows:
                continue
            key = f"{ps}_{mode}"
            oracle = [r["selected_over_oracle"] for _, r in rows]
            plain = [r["selected_over_sdpa_plain"] for _, r in rows if "selected_over_sdpa_plain" in r]
            fa4 = [sh["ratios"][ps][mode]["selected_over_sdpa_plain"] for sh in shapes
                   if sh["fa4_or_varlen"] and ps in sh["ratios"] and "selected_over_sdpa_plain" in sh["ratios"][ps].get(mode, {})]
            summary[key] = {"min_selected_over_oracle": min(oracle),
                            "min_selected_over_sdpa_plain": min(plain) if plain else None,
                            "geomean_selected_over_sdpa_plain_fa4_or_varlen":
                                math.exp(statistics.fmean(math.log(x) for x in fa4)) if fa4 else None,
                            "shapes": len(rows)}
            for label, r in rows:
                if r["selected_over_oracle"] < TARGET_ORACLE or r.get("selected_over_sdpa_plain", 9) < TARGET_PLAIN:
                    below.append({"shape": label, "pass": ps, "mode": mode, **r})
    summary["below_target"] = below
    return summary


def chart(report: dict[str, Any], path: Path) -> None:
    """Speed relative to the plain SDPA call per shape (b2b; fwd+bwd where timed): attnkit, the oracle, and
    each library's direct call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["shapes"]
    names = [AUTO, *LIBRARIES]
    fig, ax = plt.subplots(figsize=(max(12, 0.55 * len(rows)), 6))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = []
        for r in rows:
            ps = "fwdbwd" if "fwdbwd" in r["ratios"] else "fwd"
            t = r["ms"].get(n, {}).get(ps, {}).get("b2b")
            plain = r["ms"].get(PLAIN, {}).get(ps, {}).get("b2b")
            vals.append(plain / t if t and plain else 0.0)
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=n,
               edgecolor="black" if n == AUTO else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["label"] + ("" if r["shape"]["train"] else " (fwd)") for r in rows], rotation=40,
                       ha="right", fontsize=7)
    ax.set_ylabel("speed vs plain F.scaled_dot_product_attention (b2b)")
    gpu = report["environment"]["probe"]["gpus"]
    ax.set_title(f"attnkit bench: {gpu[0]['name'] if gpu else 'CPU'}, torch "
                 f"{report['environment']['probe']['torch']['version']}, {report['environment']['date'][:10]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def run_bench(out: str | None = None, quick: bool = False, png: bool = True, only: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from attnkit.errors import AttnkitError, UsageError
    from attnkit.runtime.probe import probe

    p = probe()
    if p.torch is None:
        raise AttnkitError("bench: torch is not installed; install the torch of your matrix cell first")
    device = "cuda" if p.has_gpu and p.torch.cuda_available else "cpu"
    quick = quick or device == "cpu"
    shapes_to_run = suite(quick)
    if only:
        known = {s.label for s in shapes_to_run}
        for label in only:
            if label not in known:
                raise UsageError(f"--shape: unknown shape {label!r}; known: {', '.join(sorted(known))}")
        shapes_to_run = [s for s in shapes_to_run if s.label in only]
    con = Console(width=200)
    if device == "cuda":
        warm_gpu()
    # host-side overhead first, before the big shapes leave the process with a large heap; 3 repeats (the
    # median one is reported) because the host's state moves a 50 us call by tens of percent
    repeats = sorted((dispatch_overhead(device, n=200 if quick else 2000) for _ in range(3)),
                     key=lambda r: r["overhead_us"])
    dispatch = {**repeats[1], "repeats_us": [round(r["overhead_us"], 3) for r in repeats]}
    results: list[dict[str, Any]] = []
    report: dict[str, Any] = {"environment": environment(), "device": device, "quick": quick, "shapes": results,
                              "dispatch": dispatch}
    for s in shapes_to_run:
        t0 = time.perf_counter()
        results.append(bench_shape(s, device, iters=5 if quick else 12, rounds=3 if quick else 4))
        con.print(f"bench {s.label}: {time.perf_counter() - t0:.1f} s")
        if out:  # the report so far: a run cut short by a time limit still leaves every finished shape
            write_atomic(Path(out), json.dumps({**report, "partial": True}, indent=1, default=str))
    report["summary"] = {**summarize(results), "dispatch_overhead_us": dispatch["overhead_us"],
                         "dispatch_wrapper_only_us": dispatch["wrapper_only_us"],
                         "bound_overhead_us": dispatch["bound_overhead_us"]}
    t = Table(title=f"attnkit bench on {device}: speed vs the plain SDPA call and vs the oracle (>=1: attnkit as fast)")
    for col in ("shape", "pass", "selected", "row", "oracle sync", "sel/oracle sync", "sel/oracle b2b",
                "sel/plain sync", "sel/plain b2b"):
        t.add_column(col)
    for r in results:
        for ps, modes in r["ratios"].items():
            sy, bb = modes.get("sync", {}), modes.get("b2b", {})
            t.add_row(r["label"], ps, r["selected_by_pass"][ps], r["row"][ps], str(sy.get("oracle")),
                      *(f"{m.get(k, 0):.3f}" for m, k in ((sy, "selected_over_oracle"), (bb, "selected_over_oracle"),
                                                            (sy, "selected_over_sdpa_plain"),
                                                            (bb, "selected_over_sdpa_plain"))))
    con.print(t)
    con.print(f"summary: {json.dumps({k: v for k, v in report['summary'].items() if k != 'below_target'})}")
    for b in report["summary"]["below_target"]:
        con.print(f"below target: {b}")
    if out:
        path = Path(out)
        write_atomic(path, json.dumps(report, indent=1, default=str))
        con.print(f"wrote {path}")
        if png:
            try:
                chart(report, path.with_suffix(".png"))
                con.print(f"wrote {path.with_suffix('.png')}")
            except ImportError:
                con.print("matplotlib not installed: no chart")
    return 0
