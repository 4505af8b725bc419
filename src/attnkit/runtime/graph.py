"""attention() while a graph is being recorded: torch.compile / torch.export, and torch.jit.trace (the legacy
ONNX exporter).

torch.compile: attention() hands the call to `compiled()`, which dynamo records as ONE opaque call (a
`nonstrict_trace` function: dynamo does not trace into attnkit's Python: probing, selection, caches), and
AOTAutograd then traces into it with fake tensors. There the call is described from the graph's static
properties, a backend whose call can be recorded is selected (Limits.traces), and its kernel's ops (aten
SDPA ops, flash-attn's torch.library ops) land in the graph with their backward. So a model compiles with
`fullgraph=True` in a fresh process, forward and backward, and runs the same kernel as eager; dimensions
marked dynamic stay dynamic. Under `backend="eager"` the function runs as Python: the eager path.

Decorating needs torch._dynamo, whose import costs ~2.3 s (torch 2.13, the 2-core dev machine): attnkit
registers `compiled()` when torch._dynamo is first imported (by torch.compile itself), never before.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

from attnkit.runtime.backends import Backend
from attnkit.runtime.call import AttentionCall, Inputs, dynamic_compile


def run_traced(inp: Inputs, backend: str | None, trace: str) -> Any:
    """Describe, select and run a call that is being recorded: no caches (the tensors are fake or the graph's
    inputs), no autotune (it needs real timings), no fallback (the graph keeps whatever ran)."""
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import SELECTOR

    call, params = inp.prepare(trace)
    b: Backend = SELECTOR.select(call, probe(), backend)
    return b.bind(call, params, inp.q, inp.k, inp.v)(inp.q, inp.k, inp.v)


def records_varlen(device: str, device_index: int, dtype: str, heads: int, kv_heads: int, head_dim: int,
                   head_dim_v: int, causal: bool, window: tuple[int, int] | None, softcap: bool, dropout: bool,
                   requires_grad: bool, deterministic: bool = False) -> bool:
    """Whether a graph can record a varlen call of this description: some backend's limits take it under
    torch.compile (FlashAttention-4's or flash-attn's ops, flex forward-only). A caller that can pack a padded
    batch on the device (the HF adapter) asks before choosing that over a key bias. Marked with dynamo's
    assume_constant_result when dynamo loads: run once while tracing, its answer is a constant of the graph."""
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import SELECTOR, NoBackendError

    call = AttentionCall(device=device, device_index=device_index, dtype=dtype, batch=2, seqlen_q=2, seqlen_k=2,
                         heads=heads, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                         dropout=dropout, window=window, alibi=False, bias=False, varlen=True,
                         requires_grad=requires_grad, deterministic=deterministic, softcap=softcap, trace="compile",
                         dynamic=dynamic_compile())
    try:
        SELECTOR.select(call, probe())
    except NoBackendError:
        return False
    return True


Ratio = tuple[int, int]


def constant_window(window: Any) -> Any:
    """The window as constants of the graph ((-1, -1) = none). Under dynamic=True dynamo makes ints it finds in a
    closure symbolic (SymInt), and a window chooses the kernel and the mask; nonstrict_trace then rejects the
    call ("Unsupported output type", found on the CPU for a window captured by the compiled function).
    `float(x).as_integer_ratio()` specialises a SymInt to its value (a guard), as for the float arguments.
    Anything but two whole numbers is passed on as it is, for the call's own check to reject in one line."""
    if window is None:
        return (-1, -1)
    w = tuple(window)
    if len(w) != 2 or any(isinstance(x, bool) for x in w):
        return w
    out = []
    for x in w:
        try:
            num, den = float(x).as_integer_ratio()
        except (TypeError, ValueError, OverflowError):
            return w
        if den != 1:
            return w
        out.append(int(num))
    return (out[0], out[1])


def compiled(q: Any, k: Any, v: Any, causal: bool, scale_ratio: Ratio, dropout_ratio: Ratio, window: tuple[int, int],
             softcap_ratio: Ratio, backend: str, names: tuple[str, ...], tensors: tuple[Any, ...],
             max_seqlens: tuple[int, int]) -> Any:
    """attention() under torch.compile. Arguments are what nonstrict_trace accepts (no None): scale 0 = the
    default, window (-1, -1) = none, backend "" = select, optional tensors by name, max_seqlens -1 = none.
    Floats travel as exact integer ratios: dynamo turns float arguments into graph inputs (SymFloats), and
    these choose kernels and masks, so they must stay constants."""
    from torch._subclasses.fake_tensor import is_fake

    scale, dropout_p, softcap = (r[0] / r[1] for r in (scale_ratio, dropout_ratio, softcap_ratio))
    extra = dict(zip(names, tensors, strict=True))
    inp = Inputs(q, k, v, causal=causal, softmax_scale=scale or None, dropout_p=dropout_p,
                 window=None if window == (-1, -1) else window, softcap=softcap,
                 alibi_slopes=extra.get("alibi_slopes"), attn_bias=extra.get("attn_bias"),
                 cu_seqlens_q=extra.get("cu_seqlens_q"), cu_seqlens_k=extra.get("cu_seqlens_k"),
                 max_seqlen_q=max_seqlens[0] if max_seqlens[0] >= 0 else None,
                 max_seqlen_k=max_seqlens[1] if max_seqlens[1] >= 0 else None)
    if not is_fake(q):  # run as Python (backend="eager", or a torch without nonstrict_trace): the eager path
        from attnkit.runtime import dispatch

        return dispatch.first(inp, backend or None)
    try:
        return run_traced(inp, backend or None, "compile")
    except Exception as exc:
        # dynamo reports any error raised in a nonstrict_trace function as "Unsupported output type for
        # nonstrict_trace-ed function" and prints neither it nor its message (torch 2.11-2.13): a call no backend
        # can record, or a bad argument, would reach the user as that line alone (fullgraph=True), or as a silent
        # graph break. Said here first, then raised
        warnings.warn(f"attnkit: attention() cannot be recorded into this graph: {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=1)
        raise


ENTRY = compiled  # what attention() calls under torch.compile: `compiled`, registered with dynamo once it loads


def _register() -> None:
    global ENTRY
    import torch._dynamo

    mark = getattr(torch._dynamo, "nonstrict_trace", None)  # torch >= 2.7; older ones break the graph here
    if mark is not None and ENTRY is compiled:
        ENTRY = mark(compiled)
    torch._dynamo.assume_constant_result(records_varlen)  # marks the function itself


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """Runs _register() right after torch._dynamo's own module code, whoever imports it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if "torch._dynamo" in sys.modules:
        _register()
    elif not any(isinstance(f, _OnDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnDynamoImport())
