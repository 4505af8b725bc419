"""Bound calls: the one home of "this call signature runs this backend's prepared runner".

The first call of a signature validates its inputs, selects a backend and binds a runner (the kernel call with
everything that depends only on the signature prepared: arguments, masks, the route to the kernel). Later calls
of that signature cost one dictionary lookup and the runner. A backend that raises at run time is demoted for
its shape bucket, only that bucket's bound calls are dropped, and the call is retried once on the next
candidate (bad input, out of memory and checkpoint's early stop are raised as they are: `fallback` says why). `bind()` hands the bound call to a caller that fixes its call once (per layer, as vLLM does), so it
pays no key building at all.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from attnkit.runtime.backends import Backend
from attnkit.runtime.call import AttentionCall, Inputs
from attnkit.runtime.select import SELECTOR

CACHE_MAX = 4096  # bound signatures kept per kind (dense, varlen); past it the table starts again


@dataclass(frozen=True)
class Bound:
    """A call signature's prepared runner, the backend it belongs to and the call it was bound for.
    Calling it runs the kernel on new tensors of that signature, nothing checked again."""

    runner: Callable[[Any, Any, Any], Any]
    backend: Backend
    call: AttentionCall
    bucket: tuple[Any, ...] = field(default=(), compare=False)
    # the tensors whose identity the signature includes (cu_seqlens, ALiBi slopes, attn_bias), weakly: a
    # step's tensors die with the step, and their bound call with them
    tensors: tuple[Any, ...] = field(default=(), compare=False)

    def __call__(self, q: Any, k: Any, v: Any) -> Any:
        return self.runner(q, k, v)


_DENSE: dict[tuple[Any, ...], Bound] = {}
# Signatures that include tensors by identity and in-place version: varlen's cu_seqlens (the layers of one step
# share them, so the lengths are read to the host, a device sync, once per step, not once per layer) and
# ALiBi slopes / attn_bias (whose bias or score_mod is then prepared once per tensor, not once per call).
_VARLEN: dict[tuple[Any, ...], Bound] = {}

lookup = _DENSE.get  # the hot path: one dict lookup


def lookup_varlen(key: tuple[Any, ...], *tensors: Any) -> Bound | None:
    hit = _VARLEN.get(key)
    if hit is None or len(hit.tensors) != len(tensors):
        return None
    return hit if all(r() is t for r, t in zip(hit.tensors, tensors, strict=True)) else None


def insert(key: tuple[Any, ...] | None, vkey: tuple[Any, ...] | None, bound: Bound) -> None:
    if key is not None:
        if len(_DENSE) >= CACHE_MAX:
            _DENSE.clear()
        _DENSE[key] = bound
    elif vkey is not None:
        if len(_VARLEN) >= CACHE_MAX:
            _VARLEN.clear()
        _VARLEN[vkey] = bound


def invalidate(bucket: tuple[Any, ...] | None = None) -> None:
    """Drop the bound calls of one shape bucket (a backend failed there), or all of them (None)."""
    for table in (_DENSE, _VARLEN):
        if bucket is None:
            table.clear()
        else:
            for key in [k for k, b in table.items() if b.bucket == bucket]:
                del table[key]


def bound_calls() -> list[Bound]:
    """Every bound call of this process (for reports: which backends ran)."""
    return [*_DENSE.values(), *_VARLEN.values()]


@contextlib.contextmanager
def runners_replaced(runner: Callable[[Any, Any, Any], Any]) -> Iterator[None]:
    """Every bound call runs `runner` instead while inside (the bench measures the lookup's own host cost)."""
    saved = dict(_DENSE), dict(_VARLEN)
    for table in (_DENSE, _VARLEN):
        for key, b in table.items():
            table[key] = replace(b, runner=runner)
    try:
        yield
    finally:
        for table, old in zip((_DENSE, _VARLEN), saved, strict=True):
            table.clear()
            table.update(old)


SELECTOR.on_change(invalidate)


def bind_inputs(inp: Inputs, backend: str | None) -> Bound:
    """Validate, select (autotuned when asked) and bind, without running."""
    import torch

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
            from attnkit.bench.timer import median_seconds

            return median_seconds(lambda: runner(q.detach(), k.detach(), v.detach()), call.device)

    b = SELECTOR.select(call, probe(), backend, timer=timer)
    held = tuple(weakref.ref(t) for t in identity_tensors(inp.cu_seqlens_q, inp.cu_seqlens_k, inp.alibi_slopes,
                                                           inp.attn_bias))
    return Bound(b.bind(call, params, q, k, v), b, call, call.bucket(), held)


def identity_tensors(*tensors: Any) -> tuple[Any, ...]:
    """The tensors of a call that its signature holds by identity (the order is attention()'s key's)."""
    return tuple(t for t in tensors if t is not None)


def first(inp: Inputs, backend: str | None, key: tuple[Any, ...] | None = None,
          vkey: tuple[Any, ...] | None = None) -> Any:
    """A signature seen for the first time (or never cacheable): bind, run, remember."""
    bound = bind_inputs(inp, backend)
    try:
        out = bound.runner(inp.q, inp.k, inp.v)
    except Exception as exc:
        return fallback(bound.backend, exc, inp, backend)
    insert(key, vkey, bound)
    return out


def fallback(failed: Backend, exc: Exception, inp: Inputs, backend: str | None) -> Any:
    """Retry once on the next candidate; an explicit choice never falls back. Not a kernel's failure, and handed
    on as it is, the backend kept:
    - bad input (ValueError);
    - torch.utils.checkpoint's early stop, which its non-reentrant recomputation raises from inside the last op
      that saves tensors (caught as a failure, it demoted the backend and broke the backward: "Unexpected state:
      target_frame.early_stop is set");
    - out of memory: memory pressure, not the kernel's defect. A demotion would outlive it (the bucket slower for
      the rest of the process), the next candidate needs memory too, and a batch-size finder (accelerate's
      find_executable_batch_size, Lightning's BatchSizeFinder) must see torch's own OOM, as the plain call
      raises it."""
    from attnkit.errors import out_of_memory
    from attnkit.runtime.probe import probe

    if isinstance(exc, ValueError) or type(exc).__name__ == "_StopRecomputationError" or out_of_memory(exc):
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


def bind(q: Any, k: Any, v: Any, **options: Any) -> Bound:
    """attention()'s call fixed once: validates and selects now, returns a Bound whose __call__(q, k, v) runs the
    chosen kernel for new tensors of the same shapes, dtype, device and options, with nothing checked again.
    `options` are attention()'s keyword arguments. For varlen, the cu_seqlens given here are part of the
    binding (pass new q/k/v of the same packed layout)."""
    allowed = set(Inputs.__dataclass_fields__) - {"q", "k", "v"} | {"backend"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"bind(): unknown option {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    backend = options.pop("backend", None)
    return bind_inputs(Inputs(q, k, v, **options), backend)
