"""The calls raced on one shape, each built once outside the timing: the plain SDPA call a user writes, each
library's own function as its documentation shows, attention() forced to each backend, attention() choosing."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from attnkit.runtime.shape import Shape, make_inputs

PLAIN = "sdpa_plain"
AUTO = "attnkit"
# library functions called directly, when installed; flex_flash is torch's flex on its FLASH backend, FA4's CuTe
# kernels with the score_mod compiled in: the route the issue names for ALiBi through FA4's score_mod
LIBRARIES = ("flash_attn4", "flash_attn2", "xformers", "flex", "flex_flash")
MATH_MAX_SCORES = 1 << 26  # sdpa_math materialises B*H*Sq*Sk scores: bench it only where that is small


# calls before a JIT candidate is steady: FA4's replay (runtime/backends/fa4_replay.py) runs a signature's first
# call on FA4's own path (compiling), records the second and checks the record against FA4's own call on the third
JIT_WARM_CALLS = 3


def compiles(name: str) -> bool:
    """A candidate whose backend compiles or records at first use (FA4, flex), by its name: `attnkit:<backend>`
    (attention() forced) or the library's own name. Its first calls are not steady, and it has a compile to do."""
    from attnkit.runtime.backends import REGISTRY

    b = REGISTRY.get(name.split(":", 1)[-1])
    return b is not None and b.compiles


class Case:
    """One shape's tensors and every candidate's call, built once outside the timing."""

    def __init__(self, s: Shape, device: str) -> None:
        import torch

        from attnkit.runtime.call import Inputs

        self.s, self.device = s, device
        t = make_inputs(s, device)
        self.q, self.k, self.v, self.kw = t.q, t.k, t.v, t.kw
        self.slopes = t.kw.get("alibi_slopes")
        self.cu = t.kw.get("cu_seqlens_q")
        self.inputs = Inputs(self.q, self.k, self.v, **self.kw)
        self.grad_out = torch.randn((*self.q.shape[:-1], s.head_dim), generator=t.generator, device=device,
                                    dtype=self.q.dtype)
        self.plain: Callable[[Any, Any, Any], Any] = self._make_plain()
        self.references: dict[int, Any] = {}  # bench/numerics.py: the float64 reference rows, per sequence

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

    def candidates(self, grad: bool, backends_only: bool = False) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
        """name -> a no-argument call (its output, for the check); and name -> why a candidate is absent.
        `backends_only`: attention() forced to each backend, nothing else (what a selection table ranks)."""
        from attnkit.runtime.attention import attention
        from attnkit.runtime.backends import REGISTRY
        from attnkit.runtime.probe import probe

        call = self.call(grad)
        p = probe()
        q, k, v, kw = self.q, self.k, self.v, self.kw
        runs: dict[str, Callable[[], Any]] = {}
        absent: dict[str, str] = {}
        if not backends_only:  # varlen: the plain call runs the padded batch
            pq, pk, pv = self.padded if self.s.lengths is not None else (q, k, v)
            runs[PLAIN] = lambda: self.plain(pq, pk, pv)
        for lib in () if backends_only else LIBRARIES:
            why = _library_reasons(lib, call, p)
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
        if not backends_only:
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
    from torch.nn.attention.bias import CausalBias

    from attnkit.runtime import layout

    if isinstance(mask, CausalBias):  # a causal_lower_right object (a Tensor subclass): its dense form
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


def _library_reasons(lib: str, call: Any, p: Any) -> list[str]:
    """Why a library's own call cannot run here: its backend's limits, less an opt-in that only guards what
    attention() may pick (flex's FLASH backend): the race records a library call's errors as that call's own."""
    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.backends.flex import FLASH_BROKEN

    return REGISTRY[lib].check(call, p, waive=(FLASH_BROKEN,))


def _library_call(lib: str, c: Case) -> Callable[[], Any] | None:
    """The library's own function, called as its documentation shows; None where it has no direct form."""
    s, q, k, v = c.s, c.q, c.k, c.v
    scale = 1.0 / math.sqrt(s.head_dim)
    if lib == "flash_attn4":
        from attnkit.runtime.backends.flash_attn4 import fa4_window, output_of
        from attnkit.runtime.loaders import load_fa4 as load

        fa = load()
        kw: dict[str, Any] = {"causal": s.causal}
        if s.window is not None:
            kw["window_size"] = fa4_window(s.window)
        if s.softcap:
            kw["softcap"] = s.softcap
        if s.lengths is not None:
            m = max(s.lengths)
            return lambda: output_of(fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=c.cu, cu_seqlens_k=c.cu,
                                                           max_seqlen_q=m, max_seqlen_k=m, **kw))
        return lambda: output_of(fa.flash_attn_func(q, k, v, **kw))
    if lib in ("flex", "flex_flash"):  # torch's FlexAttention as its documentation shows: compiled once, a block
        # mask built once; flex_flash: the same call with kernel_options={"BACKEND": "FLASH"} (torch >= 2.11)
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
        # dynamic=False: each shape its own graph, as a model with one size gets it; torch.compile's default makes
        # every shape after the first a dynamic graph, 1.3-1.8x slower with ALiBi (H100, 2026-12-07)
        fn = torch.compile(flex_attention, dynamic=False) if c.device == "cuda" else flex_attention
        mod = score_mod if (s.softcap or slopes is not None) else None
        gqa = s.heads != s.kv_heads
        opts = {"kernel_options": {"BACKEND": "FLASH"}} if lib == "flex_flash" else {}
        return lambda: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=mod, block_mask=block,
                          enable_gqa=gqa, **opts).transpose(1, 2)
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

