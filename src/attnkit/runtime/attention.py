"""The public `attention()`: one layout, one causal convention, every backend.

A call whose shapes, dtypes, devices and flags were seen before skips validation and selection through a
dictionary lookup, so dispatch costs a few microseconds; a backend that raises at run time is demoted for
that shape bucket and the call is retried once on the next candidate.
"""

from __future__ import annotations

import math
from typing import Any

import torch  # this module is the runtime's entry: `import attnkit` alone does not load it

from attnkit.runtime.backends import Backend, Params
from attnkit.runtime.call import AttentionCall, make_call
from attnkit.runtime.layout import pack, unpack
from attnkit.runtime.select import SELECTOR, time_backend

__all__ = ["attention", "pack", "unpack"]

_FAST: dict[tuple[Any, ...], tuple[Backend, AttentionCall, Params]] = {}
_FAST_MAX = 4096
# Varlen calls are cached per cu_seqlens tensor (identity and in-place version): the layers of one step
# share them, so the lengths are read to the host (a device sync) once per step, not once per layer.
_FAST_VARLEN: dict[tuple[Any, ...], tuple[Backend, AttentionCall, Params, Any, Any]] = {}


def _fast_key(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, dropout_p: float,
              window: Any, backend: str | None) -> tuple[Any, ...] | None:
    """The cache key of a call, built from the cheapest attributes (this runs on every call).

    k/v devices are not in the key: a mismatch makes the kernel raise, and the fallback path validates the
    call first, so the user still gets the ValueError naming the argument.
    """
    if window is not None and type(window) is not tuple:
        return None
    dt = q.dtype
    if k.dtype is not dt or v.dtype is not dt:
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (q.shape, k.shape, v.shape, dt, q.device, causal, softmax_scale, dropout_p, window, backend, grad,
            torch.are_deterministic_algorithms_enabled(), SELECTOR.generation)


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
              dropout_p: float = 0.0, window: tuple[int, int] | None = None, alibi_slopes: Any = None,
              attn_bias: Any = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              backend: str | None = None) -> Any:
    """Scaled dot-product attention on the fastest backend that can serve the call.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, kv_heads, head_dim[_v]) with
    heads % kv_heads == 0 (GQA/MQA). Varlen: (total, heads, head_dim) with int32 cu_seqlens_q/k and
    max_seqlen_q/k. `causal` is bottom-right aligned. `window=(left, right)` (-1 = unbounded) is a sliding
    window around that diagonal. `alibi_slopes`: float32 (heads,) or (batch, heads). `attn_bias`: additive,
    broadcastable to (batch, heads, seqlen_q, seqlen_k). Rows that see no key return zeros.
    `backend` (or $ATTNKIT_BACKEND) forces one backend and fails with its reasons if it cannot serve.
    Returns a tensor shaped like q with v's head_dim. Differentiable.
    """
    simple = alibi_slopes is None and attn_bias is None and cu_seqlens_q is None and cu_seqlens_k is None
    key = _fast_key(q, k, v, causal, softmax_scale, dropout_p, window, backend) if simple else None
    vkey = None
    if (not simple and alibi_slopes is None and attn_bias is None and cu_seqlens_q is not None
            and cu_seqlens_k is not None):
        base = _fast_key(q, k, v, causal, softmax_scale, dropout_p, window, backend)
        if base is not None:
            vkey = (*base, id(cu_seqlens_q), cu_seqlens_q._version, id(cu_seqlens_k), cu_seqlens_k._version,
                    max_seqlen_q, max_seqlen_k)
            vhit = _FAST_VARLEN.get(vkey)
            if vhit is not None and vhit[3]() is cu_seqlens_q and vhit[4]() is cu_seqlens_k:
                b, call, params = vhit[0], vhit[1], vhit[2]
                try:
                    return b.run(q, k, v, call, params)
                except Exception as exc:
                    return _fallback(b, exc, q, k, v, call, params, backend)
    if key is not None:
        hit = _FAST.get(key)
        if hit is not None:
            b, call, params = hit
            try:
                return b.run(q, k, v, call, params)
            except Exception as exc:
                return _fallback(b, exc, q, k, v, call, params, backend)

    from attnkit.runtime.probe import probe

    call = make_call(q, k, v, causal=causal, dropout_p=dropout_p, window=window, alibi_slopes=alibi_slopes,
                     attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: expected a positive number, got {softmax_scale!r}")
    params = Params(
        scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(call.head_dim),
        dropout_p=float(dropout_p), window=call.window, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)
    pr = probe()

    def timer(b: Backend) -> float:
        def once() -> Any:
            with torch.no_grad():
                return b.run(q.detach(), k.detach(), v.detach(), call, params)

        return time_backend(once, call.device)

    b = SELECTOR.select(call, pr, backend, timer=timer)
    try:
        out = b.run(q, k, v, call, params)
    except Exception as exc:
        return _fallback(b, exc, q, k, v, call, params, backend)
    if key is not None and call.device_index == (q.device.index or 0):
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[key] = (b, call, params)
    if vkey is not None:
        import weakref

        if len(_FAST_VARLEN) >= _FAST_MAX:
            _FAST_VARLEN.clear()
        _FAST_VARLEN[vkey] = (b, call, params, weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k))
    return out


def _fallback(failed: Backend, exc: Exception, q: Any, k: Any, v: Any, call: AttentionCall, params: Params,
              backend: str | None) -> Any:
    """Retry once on the next candidate; an explicit choice never falls back."""
    from attnkit.runtime.probe import probe

    if isinstance(exc, ValueError):
        raise exc
    # a kernel error may come from bad input that the fast path did not re-check: validate first
    make_call(q, k, v, causal=call.causal, dropout_p=params.dropout_p, window=params.window,
              alibi_slopes=params.alibi_slopes, attn_bias=params.attn_bias, cu_seqlens_q=params.cu_seqlens_q,
              cu_seqlens_k=params.cu_seqlens_k, max_seqlen_q=params.max_seqlen_q, max_seqlen_k=params.max_seqlen_k)
    if backend is not None or SELECTOR.forced is not None:
        raise exc
    SELECTOR.demote(failed.name, call, exc)
    nxt = SELECTOR.select(call, probe())
    return nxt.run(q, k, v, call, params)
