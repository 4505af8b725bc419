"""The normalised attention call: the user's arguments as ONE object (`Inputs`), validated once into a
description (`AttentionCall`) that backends say yes or no to, plus the runtime values they need (`Params`).

Layout: (batch, seqlen, heads, head_dim); packed varlen is (total, heads, head_dim) with int32 cu_seqlens.
Causal is bottom-right aligned (flash-attn >= 2.1): query i sees keys j <= i + seqlen_k - seqlen_q.
Window (left, right), -1 = unbounded, is measured from that same aligned diagonal.

Normalisation happens here, once, so no backend has to know it: bottom-right causal with one query is no
mask at all (decode), and a window under causal keeps only its left side.

A call being recorded into a graph (`trace`: "compile" for torch.compile / torch.export, "jit" for
torch.jit.trace and the legacy ONNX exporter) is described from what the graph fixes: a dimension marked
dynamic is a SymInt, described by its current size (its hint) without a guard, so selection never
specialises it; only a decision that changes the result (does the causal diagonal need a lower-right
mask?) is guarded.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_LEN = (1 << 31) - 1  # sequence lengths and windows: what every kernel's int32 indexing can hold
TRACES = {"compile": "torch.compile / torch.export", "jit": "torch.jit.trace (the legacy ONNX exporter)"}


@dataclass(frozen=True)
class AttentionCall:
    device: str  # "cuda" | "cpu" | ...
    device_index: int
    dtype: str
    batch: int
    seqlen_q: int  # max over sequences for varlen
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    causal: bool
    dropout: bool
    window: tuple[int, int] | None
    alibi: bool
    bias: bool
    varlen: bool
    requires_grad: bool
    deterministic: bool = False
    softcap: bool = False
    trace: str = ""  # "" = eager; else a key of TRACES: the call is being recorded into a graph
    symbolic: bool = False  # traced with sizes the graph keeps dynamic (SymInts: torch.compile's dynamic shapes)
    # traced by torch.compile(dynamic=True) (or with dynamo's assume_static_by_default off): every size assumed
    # dynamic, whatever it is now
    dynamic: bool = False
    # varlen only: per-sequence lengths, read once on the host while validating cu_seqlens
    lengths_q: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    lengths_k: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def varlen_same(self) -> bool:
        """Self-attention varlen: every sequence has as many queries as keys."""
        return self.varlen and self.lengths_q == self.lengths_k

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.heads

    @property
    def work(self) -> int:
        """Score-matrix elements times head_dim: what the kernel's time scales with (a causal call does
        about half, which the selection thresholds already allow for)."""
        return self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim

    def bucket(self) -> tuple[Any, ...]:
        """Autotune key: shapes rounded to powers of two, so nearby shapes share one measurement."""

        def p2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

        return (self.device, self.dtype, p2(self.batch), p2(self.seqlen_q), p2(self.seqlen_k), self.heads,
                self.kv_heads, self.head_dim, self.head_dim_v, self.causal, self.dropout, self.window, self.alibi,
                self.bias, self.varlen, self.requires_grad, self.softcap)

    def describe(self) -> str:
        parts = [f"{self.dtype}", f"B={self.batch}", f"Sq={self.seqlen_q}", f"Sk={self.seqlen_k}",
                 f"H={self.heads}", f"Hkv={self.kv_heads}", f"D={self.head_dim}"]
        if self.head_dim_v != self.head_dim:
            parts.append(f"Dv={self.head_dim_v}")
        for flag in ("causal", "dropout", "alibi", "bias", "softcap", "varlen"):
            if getattr(self, flag):
                parts.append(flag)
        if self.window:
            parts.append(f"window={self.window}")
        if self.requires_grad:
            parts.append("grad")
        if self.trace:
            parts.append(f"traced by {TRACES[self.trace]}" + (" with every size dynamic" if self.dynamic else
                                                               " with dynamic sizes" if self.symbolic else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Params:
    """Runtime values a backend needs beyond the call's description: the normalised scalars, and the call's
    other tensors, read through to the Inputs they came from."""

    scale: float
    dropout_p: float
    window: tuple[int, int] | None
    softcap: float
    inputs: Inputs

    @property
    def alibi_slopes(self) -> Any:
        return self.inputs.alibi_slopes

    @property
    def attn_bias(self) -> Any:
        return self.inputs.attn_bias

    @property
    def cu_seqlens_q(self) -> Any:
        return self.inputs.cu_seqlens_q

    @property
    def cu_seqlens_k(self) -> Any:
        return self.inputs.cu_seqlens_k

    @property
    def max_seqlen_q(self) -> int | None:
        return self.inputs.max_seqlen_q

    @property
    def max_seqlen_k(self) -> int | None:
        return self.inputs.max_seqlen_k


def _fail(arg: str, msg: str) -> ValueError:
    return ValueError(f"{arg}: {msg}")


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


MAX_FACTOR = 1e6  # softmax_scale and softcap: beyond it scores overflow (NaN), or the cap caps nothing


def _shown(x: Any) -> str:
    """A value for an error line: short, and never an error itself (repr of a 5000-digit int raises)."""
    try:
        text = repr(x)
    except ValueError:
        return f"an int of {x.bit_length()} bits" if isinstance(x, int) else type(x).__name__
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Inputs:
    """One attention() call's arguments as given. Built once per call (attention(), its fallback, the bench
    and the smoke all use this object); `describe()` validates them, `params()` derives the runtime values."""

    q: Any
    k: Any
    v: Any
    causal: bool = False
    softmax_scale: float | None = None
    dropout_p: float = 0.0
    window: Any = None
    softcap: float = 0.0
    alibi_slopes: Any = None
    attn_bias: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    def prepare(self, trace: str = "") -> tuple[AttentionCall, Params]:
        call = self.describe(trace)
        return call, self.params(call)

    def params(self, call: AttentionCall) -> Params:
        scale = self.softmax_scale
        return Params(scale=float(scale) if scale is not None else 1.0 / math.sqrt(call.head_dim),
                      dropout_p=float(self.dropout_p), window=call.window, softcap=float(self.softcap), inputs=self)

    def describe(self, trace: str = "") -> AttentionCall:
        """Validate (ValueError naming the argument) and describe the call. Runs before any kernel.
        `trace`: the graph the call is being recorded into, if any (see the module's docstring)."""
        import torch

        q, k, v = self.q, self.k, self.v
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
        varlen = self.cu_seqlens_q is not None or self.cu_seqlens_k is not None
        rank = 3 if varlen else 4
        layout = "(total, heads, head_dim) for varlen" if varlen else "(batch, seqlen, heads, head_dim)"
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != rank:
                raise _fail(name, f"expected {rank} dims {layout}, got shape {tuple(t.shape)}")
            if _dtype_name(t) not in _FLOAT_DTYPES:
                raise _fail(name, f"dtype {_dtype_name(t)} is not supported; use float16, bfloat16, float32 or float64")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype:
                raise _fail(name, f"dtype {_dtype_name(t)} differs from q's {_dtype_name(q)}")
            if t.device != q.device:
                raise _fail(name, f"device {t.device} differs from q's {q.device}")
        if q.shape[-1] != k.shape[-1]:
            raise _fail("k", f"head_dim {k.shape[-1]} differs from q's {q.shape[-1]}")
        if q.shape[-1] == 0 or v.shape[-1] == 0:
            raise _fail("q" if q.shape[-1] == 0 else "v", "head_dim must be >= 1")
        if k.shape[:-1] != v.shape[:-1]:
            raise _fail("v", f"shape {tuple(v.shape)} does not match k's {tuple(k.shape)} except head_dim")
        heads, kv_heads = q.shape[-2], k.shape[-2]
        if kv_heads == 0 or heads % kv_heads:
            raise _fail("k", f"q has {heads} heads, which is not a multiple of k's {kv_heads} heads")
        s = self.softmax_scale
        if s is not None and not (isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s <= MAX_FACTOR):
            raise _fail("softmax_scale", f"expected a positive number up to {MAX_FACTOR:g} (larger scores overflow), "
                                         f"got {_shown(s)}")
        if not isinstance(self.dropout_p, (int, float)) or not 0.0 <= self.dropout_p < 1.0:
            raise _fail("dropout_p", f"must be in [0, 1), got {self.dropout_p}")
        if (not isinstance(self.softcap, (int, float)) or isinstance(self.softcap, bool)
                or not 0 <= self.softcap <= MAX_FACTOR):
            raise _fail("softcap", f"expected a number from 0 (off) up to {MAX_FACTOR:g}, got {_shown(self.softcap)}")
        try:
            bool(self.causal)
        except (RuntimeError, TypeError, ValueError):  # a tensor of several values, ...
            raise _fail("causal", f"expected True or False, got {type(self.causal).__name__}") from None
        window = _check_window(self.window)

        lengths_q = lengths_k = None
        if varlen:
            if self.cu_seqlens_q is None or self.cu_seqlens_k is None:
                raise _fail("cu_seqlens_q" if self.cu_seqlens_q is None else "cu_seqlens_k",
                            "varlen needs both cu_seqlens_q and cu_seqlens_k")
            if self.max_seqlen_q is None or self.max_seqlen_k is None:
                raise _fail("max_seqlen_q" if self.max_seqlen_q is None else "max_seqlen_k", "required with cu_seqlens")
            if trace == "compile":  # the lengths are device data: a graph cannot read them on the host
                for name, cu in (("cu_seqlens_q", self.cu_seqlens_q), ("cu_seqlens_k", self.cu_seqlens_k)):
                    _check_cu_tensor(cu, name, q)
                batch = _size(self.cu_seqlens_q.shape[0]) - 1
                if _size(self.cu_seqlens_k.shape[0]) - 1 != batch:
                    raise _fail("cu_seqlens_k", "describes a different number of sequences than cu_seqlens_q")
            else:
                lengths_q = _check_cu(self.cu_seqlens_q, "cu_seqlens_q", q, self.max_seqlen_q, "max_seqlen_q")
                lengths_k = _check_cu(self.cu_seqlens_k, "cu_seqlens_k", k, self.max_seqlen_k, "max_seqlen_k")
                batch, batch_k = len(lengths_q), len(lengths_k)
                if batch != batch_k:
                    raise _fail("cu_seqlens_k", f"describes {batch_k} sequences, cu_seqlens_q {batch}")
            sq, sk = _size(self.max_seqlen_q), _size(self.max_seqlen_k)
            if lengths_q is not None and lengths_k is not None:
                # the longest sequence read from cu_seqlens, not the caller's bound (which may be loose: a padded
                # length): padded routes allocate by it, native kernels still get the caller's max_seqlen
                sq, sk = max(lengths_q, default=0), max(lengths_k, default=0)
        else:
            batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            if k.shape[0] != batch:
                raise _fail("k", f"batch {k.shape[0]} differs from q's {batch}")
            if trace and self.causal and not (type(sq) is int and type(sk) is int):
                bool(sq == sk)  # a guard: the graph is valid only while the diagonal's alignment holds

        alibi, bias = self.alibi_slopes, self.attn_bias
        if alibi is not None:
            if not isinstance(alibi, torch.Tensor) or alibi.dtype != torch.float32:
                raise _fail("alibi_slopes", "expected a float32 tensor of shape (heads,) or (batch, heads)")
            if tuple(alibi.shape) not in ((heads,), (batch, heads)):
                raise _fail("alibi_slopes", f"shape {tuple(alibi.shape)} is not ({heads},) or ({batch}, {heads})")
            if alibi.device != q.device:
                raise _fail("alibi_slopes", f"device {alibi.device} differs from q's {q.device}")
        if bias is not None:
            if not isinstance(bias, torch.Tensor):
                raise _fail("attn_bias", f"expected a tensor broadcastable to (batch, heads, {sq}, {sk})")
            if varlen:
                raise _fail("attn_bias", "is not supported with varlen (cu_seqlens); pad the batch instead")
            if bias.dim() > 4:
                raise _fail("attn_bias", f"has {bias.dim()} dimensions; expected at most 4 (batch, heads, {sq}, {sk})")
            try:
                torch.broadcast_shapes(tuple(bias.shape), (batch, heads, sq, sk))
            except RuntimeError:
                raise _fail("attn_bias", f"shape {tuple(bias.shape)} does not broadcast to "
                                         f"(batch, heads, seqlen_q, seqlen_k) = ({batch}, {heads}, {sq}, {sk})") from None
            if bias.device != q.device:
                raise _fail("attn_bias", f"device {bias.device} differs from q's {q.device}")

        causal, window = normalise_mask(bool(self.causal), _size(sq), window)
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return AttentionCall(
            device=q.device.type,
            device_index=q.device.index or 0,
            dtype=_dtype_name(q),
            batch=_size(batch),
            seqlen_q=_size(sq),
            seqlen_k=_size(sk),
            heads=_size(heads),
            kv_heads=_size(kv_heads),
            head_dim=_size(q.shape[-1]),
            head_dim_v=_size(v.shape[-1]),
            causal=causal,
            dropout=self.dropout_p > 0.0,
            window=window,
            alibi=alibi is not None,
            bias=bias is not None,
            varlen=varlen,
            requires_grad=requires_grad,
            deterministic=requires_grad and torch.are_deterministic_algorithms_enabled(),
            softcap=self.softcap > 0,
            trace=trace,
            symbolic=bool(trace) and any(type(n) is not int for t in (q, k, v, alibi, bias) if t is not None
                                         for n in t.shape),
            dynamic=trace == "compile" and dynamic_compile(),
            lengths_q=lengths_q,
            lengths_k=lengths_k,
        )


def normalise_mask(causal: bool, seqlen_q: int, window: tuple[int, int] | None
                   ) -> tuple[bool, tuple[int, int] | None]:
    """One query sees every key under bottom-right causal: no mask at all (decode). Under causal, a window
    keeps only its left side (causal already bounds the right)."""
    causal = causal and seqlen_q > 1
    if causal and window is not None:
        window = None if window[0] == -1 else (window[0], 0)
    return causal, window


def _check_window(window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and -1 <= w <= MAX_LEN for w in window)):
        raise _fail("window", f"expected (left, right) ints >= -1 and <= {MAX_LEN} (-1 = unbounded), got "
                              f"{str(window)[:60]}")
    left, right = int(window[0]), int(window[1])
    return None if (left, right) == (-1, -1) else (left, right)


def _size(n: Any) -> int:
    """A size as a plain int: a SymInt (a dimension torch.compile keeps dynamic) by its current value, read
    without a guard, so describing the call never specialises the graph to one size."""
    if type(n) is int:
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else int(n)


def _check_cu_tensor(cu: Any, name: str, t: Any) -> None:
    import torch

    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
        raise _fail(name, "expected a 1-D int32 tensor [0, len0, len0+len1, ...] with batch+1 entries")
    if cu.device != t.device:
        raise _fail(name, f"device {cu.device} differs from the tensors' {t.device}")


def _check_cu(cu: Any, name: str, t: Any, max_len: int, max_name: str) -> tuple[int, ...]:
    _check_cu_tensor(cu, name, t)
    host = cu.tolist()  # one small sync; varlen inputs are validated once per cu_seqlens tensor
    if host[0] != 0:
        raise _fail(name, f"must start at 0, starts at {host[0]}")
    lengths = [b - a for a, b in itertools.pairwise(host)]
    if any(n < 0 for n in lengths):
        raise _fail(name, "must be non-decreasing")
    if host[-1] != t.shape[0]:
        raise _fail(name, f"ends at {host[-1]} but the packed tensor has {t.shape[0]} rows")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < max(lengths):
        raise _fail(max_name, f"{max_len!r} is smaller than the longest sequence ({max(lengths)})")
    if max_len > MAX_LEN:
        raise _fail(max_name, f"{max_len} is not a sequence length (at most {MAX_LEN}); the longest sequence "
                              f"is {max(lengths)}")
    return tuple(lengths)


def dynamic_compile() -> bool:
    """Is torch.compile tracing with dynamic=True? It then assumes no size static (dynamo's config, patched for the
    trace): a call whose sizes are plain ints now may still be compiled for every size (nothing tells them apart)."""
    try:
        import torch._dynamo

        return not torch._dynamo.config.assume_static_by_default
    except (ImportError, AttributeError):
        return False
