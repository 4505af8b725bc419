"""The public `attention()`: one layout, one causal convention, every backend.

The first call of a signature (shapes, dtype, device, flags) validates its inputs, selects a backend and
binds a runner: the backend's kernel call with everything that depends only on the signature prepared
(arguments, masks, the route to the kernel). Later calls of that signature cost one dictionary lookup and the
runner: 2.5 us of host time over the plain library call on the H200 (docs/results/2026-11-30-h200-bench.json,
"dispatch"), more per call with a device sync (docs/results/2026-11-30-h200-host-path.json). A backend that raises at run time is demoted for that shape bucket and the call is retried once
on the next candidate.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch  # this module is the runtime's entry: `import attnkit` alone does not load it

from attnkit.runtime import graph
from attnkit.runtime.backends import Backend
from attnkit.runtime.call import AttentionCall, Inputs
from attnkit.runtime.layout import pack, unpack
from attnkit.runtime.select import SELECTOR, time_backend

__all__ = ["attention", "pack", "unpack"]

_CACHE_MAX = 4096
# signature -> (runner, backend, call)
_FAST: dict[tuple[Any, ...], tuple[Any, Backend, AttentionCall]] = {}
# Varlen signatures also hold the cu_seqlens tensors (identity and in-place version): the layers of one step
# share them, so the lengths are read to the host (a device sync) once per step, not once per layer.
_FAST_VARLEN: dict[tuple[Any, ...], tuple[Any, Backend, AttentionCall, Any, Any]] = {}


def clear_cache() -> None:
    """Forget every bound call (the selector calls this whenever a decision may change)."""
    _FAST.clear()
    _FAST_VARLEN.clear()


SELECTOR.on_change(clear_cache)
graph.install()
# the two graph checks every call pays, bound once (~0.2 us together; dynamo knows is_compiling by identity)
_compiling = torch.compiler.is_compiling
_jit_tracing = torch._C._get_tracing_state


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
    (batch, heads, seqlen_q, seqlen_k). Rows that see no key return zeros.
    `backend` (or $ATTNKIT_BACKEND) forces one backend and fails with its reasons if it cannot serve.
    Returns a tensor shaped like q with v's head_dim. Differentiable. Inside torch.compile (fullgraph too),
    torch.export and torch.jit.trace the chosen kernel is recorded into the graph (runtime/graph.py).
    """
    if _compiling():
        names = tuple(n for n, t in (("alibi_slopes", alibi_slopes), ("attn_bias", attn_bias),
                                     ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)) if t is not None)
        tensors = tuple(t for t in (alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k) if t is not None)
        return graph.ENTRY(q, k, v, bool(causal), float(softmax_scale or 0.0).as_integer_ratio(),
                           float(dropout_p).as_integer_ratio(), tuple(window) if window is not None else (-1, -1),  # type: ignore[arg-type]
                           float(softcap).as_integer_ratio(), backend or "",
                           names, tensors, (-1 if max_seqlen_q is None else max_seqlen_q,
                                            -1 if max_seqlen_k is None else max_seqlen_k))
    if _jit_tracing() is not None:  # torch.jit.is_tracing() without its wrapper
        return graph.run_traced(_inputs(**locals()), backend, "jit")
    if alibi_slopes is None and attn_bias is None:  # per-call tensor values: such calls are never cached
        dt = q.dtype
        if k.dtype is dt and v.dtype is dt and (window is None or type(window) is tuple):
            grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            key = (q.shape, k.shape, v.shape, dt, q.device, causal, softmax_scale, dropout_p, window, softcap,
                   backend, grad, grad and torch.are_deterministic_algorithms_enabled())
            if cu_seqlens_q is None and cu_seqlens_k is None:
                hit = _FAST.get(key)
                if hit is not None:
                    try:
                        return hit[0](q, k, v)
                    except Exception as exc:
                        return _fallback(hit[1], exc, _inputs(**locals()), backend)
                return _first(_inputs(**locals()), backend, key, None)
            if cu_seqlens_q is not None and cu_seqlens_k is not None:
                vkey = (*key, id(cu_seqlens_q), cu_seqlens_q._version, id(cu_seqlens_k), cu_seqlens_k._version,
                        max_seqlen_q, max_seqlen_k)
                vhit = _FAST_VARLEN.get(vkey)
                if vhit is not None and vhit[3]() is cu_seqlens_q and vhit[4]() is cu_seqlens_k:
                    try:
                        return vhit[0](q, k, v)
                    except Exception as exc:
                        return _fallback(vhit[1], exc, _inputs(**locals()), backend)
                return _first(_inputs(**locals()), backend, None, vkey)
    return _first(_inputs(**locals()), backend, None, None)


def _inputs(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, dropout_p: float, window: Any,
            softcap: float, alibi_slopes: Any, attn_bias: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
            max_seqlen_q: int | None, max_seqlen_k: int | None, **_: Any) -> Inputs:
    return Inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p, window=window,
                  softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _first(inp: Inputs, backend: str | None, key: tuple[Any, ...] | None, vkey: tuple[Any, ...] | None) -> Any:
    """A signature seen for the first time (or never cacheable): validate, select, bind, run, remember."""
    from attnkit.runtime.probe import probe

    call, params = inp.prepare()
    q, k, v = inp.q, inp.k, inp.v
    if call.device == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"attention(): the first call of a signature ({call.describe()}) came inside CUDA-graph "
                           "capture; call it once before capturing (the warm-up torch.cuda.graphs asks for): "
                           "probing, selection and a kernel's own set-up cannot be captured")

    def timer(b: Backend) -> float:  # autotune: time a candidate on detached copies, compile excluded
        with torch.no_grad():
            runner = b.bind(call, params, q.detach(), k.detach(), v.detach())
            return time_backend(lambda: runner(q.detach(), k.detach(), v.detach()), call.device)

    b = SELECTOR.select(call, probe(), backend, timer=timer)
    try:
        runner = b.bind(call, params, q, k, v)
        out = runner(q, k, v)
    except Exception as exc:
        return _fallback(b, exc, inp, backend)
    if key is not None:
        if len(_FAST) >= _CACHE_MAX:
            _FAST.clear()
        _FAST[key] = (runner, b, call)
    elif vkey is not None:
        if len(_FAST_VARLEN) >= _CACHE_MAX:
            _FAST_VARLEN.clear()
        _FAST_VARLEN[vkey] = (runner, b, call, weakref.ref(inp.cu_seqlens_q), weakref.ref(inp.cu_seqlens_k))
    return out


def _fallback(failed: Backend, exc: Exception, inp: Inputs, backend: str | None) -> Any:
    """Retry once on the next candidate; an explicit choice never falls back."""
    from attnkit.runtime.probe import probe

    if isinstance(exc, ValueError):
        raise exc
    # a kernel error may come from bad input that the cached path did not re-check: validate first
    call, params = inp.prepare()
    if backend is not None or SELECTOR.forced is not None:
        if not str(exc).strip():  # never an empty message: say which backend failed on what
            raise RuntimeError(f"{failed.name}: {type(exc).__name__} at run time, for {call.describe()}") from exc
        raise exc
    SELECTOR.demote(failed.name, call, exc)
    nxt = SELECTOR.select(call, probe())
    return nxt.run(inp.q, inp.k, inp.v, call, params)
