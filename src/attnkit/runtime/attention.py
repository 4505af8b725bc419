"""The public `attention()`: one layout, one causal convention, every backend.

This module builds the call's signature key and asks dispatch.py (the home of bound calls, selection on a
first call and run-time fallback) for its runner: one dictionary lookup and the runner on a repeated call,
2.5 us of host time over the plain library call on the H200 (docs/results/2026-11-30-h200-bench.json,
"dispatch"), more per call with a device sync (docs/results/2026-11-30-h200-host-path.json). A caller that
fixes its call once skips even the key: `attnkit.bind()`.
"""

from __future__ import annotations

from typing import Any

import torch  # this module is the runtime's entry: `import attnkit` alone does not load it

from attnkit.runtime import dispatch, graph
from attnkit.runtime.call import Inputs
from attnkit.runtime.layout import pack, unpack

__all__ = ["attention", "pack", "unpack"]

graph.install()
# the two graph checks every call pays, bound once (~0.2 us together; dynamo knows is_compiling by identity)
_compiling = torch.compiler.is_compiling
_jit_tracing = torch._C._get_tracing_state
_lookup = dispatch.lookup


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
              dropout_p: float = 0.0, window: tuple[int, int] | None = None, softcap: float = 0.0,
              alibi_slopes: Any = None, attn_bias: Any = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, backend: str | None = None) -> Any:
    """Scaled dot-product attention on the fastest backend that can serve the call.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, kv_heads, head_dim[_v]) with
    heads % kv_heads == 0 (GQA/MQA). Varlen: (total, heads, head_dim) with int32 cu_seqlens_q/k and
    max_seqlen_q/k. `causal` is bottom-right aligned. `window=(left, right)` (-1 = unbounded) is a sliding
    window around that diagonal. `softcap` > 0 caps scores as softcap * tanh(score / softcap) (Gemma 2).
    `alibi_slopes`: float32 (heads,) or (batch, heads). `attn_bias`: additive, broadcastable to
    (batch, heads, seqlen_q, seqlen_k). Rows that see no key return zeros. cu_seqlens, slopes and bias are
    cached by identity and torch's in-place version: change them with torch ops, not through `.data`.
    `backend` (or $ATTNKIT_BACKEND) forces one backend and fails with its reasons if it cannot serve.
    Returns a tensor shaped like q with v's head_dim. Differentiable. Inside torch.compile (fullgraph too),
    torch.export (non-strict, its default; strict export fails inside torch 2.13) and torch.jit.trace the
    chosen kernel is recorded into the graph (runtime/graph.py).
    """
    if _compiling():
        names = tuple(n for n, t in (("alibi_slopes", alibi_slopes), ("attn_bias", attn_bias),
                                     ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)) if t is not None)
        tensors = tuple(t for t in (alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k) if t is not None)
        return graph.ENTRY(q, k, v, bool(causal), float(softmax_scale or 0.0).as_integer_ratio(),
                           float(dropout_p).as_integer_ratio(), graph.constant_window(window),
                           float(softcap).as_integer_ratio(), backend or "",
                           names, tensors, (-1 if max_seqlen_q is None else max_seqlen_q,
                                            -1 if max_seqlen_k is None else max_seqlen_k))
    if _jit_tracing() is not None:  # torch.jit.is_tracing() without its wrapper
        return graph.run_traced(_inputs(**locals()), backend, "jit")
    try:
        dt = q.dtype
        same = k.dtype is dt and v.dtype is dt
    except AttributeError:  # not tensors: validation says which argument, in one line
        same = False
    if same and (window is None or type(window) is tuple):
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        key = (q.shape, k.shape, v.shape, dt, q.device, causal, softmax_scale, dropout_p, window, softcap,
               backend, grad, grad and torch.are_deterministic_algorithms_enabled())
        if cu_seqlens_q is None and cu_seqlens_k is None and alibi_slopes is None and attn_bias is None:
            hit = _lookup(key)
            if hit is not None:
                try:
                    return hit.runner(q, k, v)
                except Exception as exc:
                    return dispatch.fallback(hit.backend, exc, _inputs(**locals()), backend)
            return dispatch.first(_inputs(**locals()), backend, key, None)
        # tensors in the signature by identity and in-place version (a learned bias, one that requires grad,
        # is bound anew for every call: what was prepared from it would leave its autograd graph)
        held = dispatch.identity_tensors(cu_seqlens_q, cu_seqlens_k, alibi_slopes, attn_bias)
        if (cu_seqlens_q is None) == (cu_seqlens_k is None) and all(
                type(t) is torch.Tensor and not t.requires_grad for t in held):
            vkey = (*key, *((id(t), t._version, t.shape) for t in held), alibi_slopes is None, max_seqlen_q,
                    max_seqlen_k)
            vhit = dispatch.lookup_varlen(vkey, *held)
            if vhit is not None:
                try:
                    return vhit.runner(q, k, v)
                except Exception as exc:
                    return dispatch.fallback(vhit.backend, exc, _inputs(**locals()), backend)
            return dispatch.first(_inputs(**locals()), backend, None, vkey)
    return dispatch.first(_inputs(**locals()), backend, None, None)


def _inputs(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, dropout_p: float, window: Any,
            softcap: float, alibi_slopes: Any, attn_bias: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
            max_seqlen_q: int | None, max_seqlen_k: int | None, **_: Any) -> Inputs:
    return Inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p, window=window,
                  softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
