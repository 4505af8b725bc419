"""FlashAttention-4 as torch.library custom ops, so that graphs record it as eager runs it.

FlashAttention-4 (4.0.0b36) has no torch.library ops of its own: its `flash_attn_func` is a Python
autograd.Function over CuTe DSL kernels, which dynamo and AOTAutograd cannot trace. Under torch.compile attnkit
therefore ruled FA4 out, and a compiled model ran cuDNN with masks built in the graph (H200: 0.17 of eager's
speed on a sliding window, 0.62 on chunked prefill; docs/results/2026-12-01-h200-compile-before-ops.json,
measured from outside the project).

Four ops (defined through torch.library.Library: ops() says why not `custom_op`):
- `attnkit::fa4_fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k, scale, causal,
  window_left, window_right, softcap) -> (out, lse)`; window -1 = unbounded, max_seqlen -1 = not varlen.
  Autograd-complete (`register_autograd`, backward fa4_bwd): what torch.export records for a call that needs a
  gradient, so an exported program trains, and what anyone calling the op directly gets.
- `attnkit::fa4_bwd(dout, q, k, v, out, lse, ..., deterministic) -> (dq, dk, dv)`, fa4_fwd's backward.
- `attnkit::fa4_fwd_raw(...)`: fa4_fwd without an autograd kernel, for torch.compile's training graphs. There
  the autograd formula is `graph_function()`, an autograd.Function over fa4_fwd_raw and fa4_bwd that AOTAutograd
  traces into the same forward and backward graphs. A `register_autograd` kernel is Python that a compiled graph
  runs on every call, needed or not (its forward runs with grad off): ~30 us of host time a compiled forward on
  the H200 (2026-12-02 profile of a compiled window-1024 call); 10-30% of a compiled one-op fwd+bwd step's host
  time on the 2-core dev CPU over five runs of tools/probe-compile-host.py (the one kept,
  docs/results/2026-12-05-dev-compile-host-probe.json: 145.5 us with the kernels, 130.9 without). Without one,
  the graph's calls take torch's C++ autograd fallback. fa4_bwd has none either: the double backward it would
  refuse is refused by the formulas instead (NO_DOUBLE_BACKWARD).
- `attnkit::fa4_fwd_infer(q, k, v, ...) -> out`: the forward of a graph that needs no gradient (inference, or
  the no_grad parts of a step); it writes no log-sum-exp (one allocation fewer), as FA4's own eager call
  without autograd does. The runtime records it only for calls traced without grad (FlashAttn4.bind); a graph
  whose inputs require grad is another graph to dynamo (its guards).
Their fake implementations give FA4's output and log-sum-exp shapes (lse: (batch, heads, seqlen_q) float32, or
(heads, total_q) for varlen: `_flash_attn_fwd`'s own allocation) without importing `flash_attn.cute` (4-5 s):
the real module loads only when a real call runs. dynamo records the ops, AOTAutograd keeps the backward op,
torch.export (non-strict, its default) keeps fa4_fwd with its backward, and CUDA graphs capture them like the
eager call (FA4 compiles on first use, which warmup pays: `attnkit warmup` runs attention(), whose compiled path
goes through these same kernels). FA4 has no double backward: in eager and export a backward asked to build a
graph (create_graph=True) raises NO_DOUBLE_BACKWARD; through a compiled graph a double backward is refused by
torch itself ("torch.compile with aot_autograd does not currently support double backward").
"""

from __future__ import annotations

import functools
from typing import Any

# imported here, not per call: it imports neither torch nor flash_attn
from attnkit.runtime.backends import fa4_replay

NS = "attnkit"
_ARGS = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, "
         "bool causal, int window_left, int window_right, float softcap")
FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor)"
INFER_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_ARGS}) -> Tensor"
BWD_SCHEMA = (f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_ARGS}, bool deterministic) "
              "-> (Tensor, Tensor, Tensor)")


def _window(w: int) -> int | None:
    return None if w < 0 else w


_LIB: list[Any] = []  # the torch.library.Library holding the ops: registrations live as long as it does


@functools.cache
def ops() -> Any:
    """Register the four ops (once per process) and return torch.ops.attnkit.

    Defined with torch.library.Library, not `torch.library.custom_op`: a custom_op's device kernel runs inside its
    `backend_impl` wrapper, which checks the outputs against the inputs for aliasing on every call. On the H200
    (torch 2.11) that wrapper took 0.43 ms of host time per forward call and 0.77 ms per forward+backward
    (cProfile, docs/results/2026-12-01-h200-compiled-session5-before-ops-fix.json: compiled 0.57 of eager back
    to back on a sliding window, while the plain SDPA call compiled kept 1.02 of its eager speed). Here the
    dispatcher calls the kernel directly; FA4 allocates its outputs, so they alias nothing."""
    import torch
    from torch import Tensor

    lib = torch.library.Library(NS, "FRAGMENT")
    _LIB.append(lib)
    lib.define(f"fa4_fwd{FWD_SCHEMA}")
    lib.define(f"fa4_fwd_raw{FWD_SCHEMA}")
    lib.define(f"fa4_bwd{BWD_SCHEMA}")
    lib.define(f"fa4_fwd_infer{INFER_SCHEMA}")

    def fa4_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                window_right: int, softcap: float) -> tuple[Tensor, Tensor]:
        return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_left, window_right, softcap, lse=True)

    def fa4_fwd_infer(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                      max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                      window_right: int, softcap: float) -> Tensor:
        return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_left, window_right, softcap, lse=False)[0]

    lib.impl("fa4_fwd", fa4_fwd, "CUDA")
    lib.impl("fa4_fwd_raw", fa4_fwd, "CUDA")
    lib.impl("fa4_bwd", backward_kernels, "CUDA")
    lib.impl("fa4_fwd_infer", fa4_fwd_infer, "CUDA")

    def fwd_fake(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                 *_: Any) -> tuple[Tensor, Tensor]:
        return fake_outputs(q, v, cu_seqlens_q is not None)

    def bwd_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *_: Any) -> tuple[Tensor, Tensor, Tensor]:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    torch.library.register_fake(f"{NS}::fa4_fwd", fwd_fake, lib=lib)
    torch.library.register_fake(f"{NS}::fa4_fwd_raw", fwd_fake, lib=lib)
    torch.library.register_fake(f"{NS}::fa4_bwd", bwd_fake, lib=lib)
    torch.library.register_fake(f"{NS}::fa4_fwd_infer",
                                lambda q, k, v, cu_q, *_: fake_outputs(q, v, cu_q is not None)[0], lib=lib)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, Any]) -> None:
        q, k, v, cu_q, cu_k, *args = inputs
        _save(ctx, q, k, v, *output, cu_q, cu_k, (*args, torch.are_deterministic_algorithms_enabled()))

    def backward(ctx: Any, dout: Any, _dlse: Any) -> tuple[Any, ...]:
        return (*_gradients(ctx, dout, torch.ops.attnkit.fa4_bwd), *(None,) * 9)

    torch.library.register_autograd(f"{NS}::fa4_fwd", backward, setup_context=setup_context, lib=lib)
    return torch.ops.attnkit


def fake_outputs(q: Any, v: Any, varlen: bool) -> tuple[Any, Any]:
    """FA4's (out, lse) for these inputs, allocated like `_flash_attn_fwd` does (no kernel, no import)."""
    import torch

    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if varlen:  # (total_q, heads, d) -> lse (heads, total_q)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:  # (batch, seqlen_q, heads, d) -> lse (batch, heads, seqlen_q)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


def forward(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float, *,
            lse: bool) -> tuple[Any, Any]:
    """FA4's forward (out, lse) in the ops' arguments, through fa4_replay (FA4's host path recorded once per
    signature, then replayed): the one forward that the ops and the eager autograd path (`eager_function`) share."""
    varlen = cu_seqlens_q is not None
    return fa4_replay.forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None,
        softmax_scale=softmax_scale, causal=causal, softcap=softcap,  # as FlashAttnFunc passes it (0.0 = off)
        window_size_left=_window(window_left), window_size_right=_window(window_right), return_lse=lse)


def backward_kernels(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                     max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                     window_right: int, softcap: float, deterministic: bool) -> tuple[Any, Any, Any]:
    """FA4's backward (dq, dk, dv) as FlashAttnFunc's backward calls it, its host path replayed (fa4_replay.backward):
    the fa4_bwd op's kernel, and `eager_function`'s backward."""
    varlen = cu_seqlens_q is not None
    return fa4_replay.backward(
        dout.contiguous(), q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, softcap=softcap,
        window_size_left=_window(window_left), window_size_right=_window(window_right),
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None,
        deterministic=deterministic)


NO_DOUBLE_BACKWARD = ("flash_attn4: FlashAttention-4 has no double backward (a gradient of its gradients, "
                      "create_graph=True); use attention(..., backend='sdpa_math') for that call")


def _save(ctx: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_q: Any, cu_k: Any, args: tuple[Any, ...]) -> None:
    """What FlashAttnFunc saves for its backward; `args`: the ops' scalars after cu_seqlens, then deterministic."""
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = args


def _gradients(ctx: Any, dout: Any, bwd: Any) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) from what `_save` kept; a backward asked to build a graph (create_graph=True) is refused."""
    import torch

    if torch.is_grad_enabled():
        raise RuntimeError(NO_DOUBLE_BACKWARD)
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv


def _function(fwd: Any, bwd: Any, name: str) -> Any:
    """FlashAttnFunc's autograd over a (forward -> (out, lse), backward -> (dq, dk, dv)) pair in the ops'
    arguments: the same saved (q, k, v, out, lse), the same backward call. FA4 has no double backward: a
    backward asked to build a graph (create_graph=True) raises, naming the way out, instead of giving zeros."""
    import torch

    class Fa4Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, mq: int, mk: int, scale: float,
                    causal: bool, wl: int, wr: int, cap: float, deterministic: bool) -> Any:
            out, lse = fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, wl, wr, cap)
            _save(ctx, q, k, v, out, lse, cu_q, cu_k, (mq, mk, scale, causal, wl, wr, cap, deterministic))
            return out

        @staticmethod
        def backward(ctx: Any, dout: Any) -> tuple[Any, ...]:
            return (*_gradients(ctx, dout, bwd), *(None,) * 10)

    Fa4Function.__name__ = Fa4Function.__qualname__ = name
    return Fa4Function


@functools.cache
def eager_function() -> Any:
    """FA4 with autograd in eager mode: the forward and the backward through fa4_replay.

    FA4's `flash_attn_func` under autograd runs its whole forward host path on every call (its autograd.Function
    does not know attnkit's replay): ~100-130 us of Python a training step on the H200 before the kernel starts.
    This is FlashAttnFunc's forward and backward with both host paths replayed: the same kernels with the same
    arguments. The kernels are called directly, not through the ops: eager needs no graph, and an op's dispatch
    into Python costs host time on every call."""
    return _function(functools.partial(forward, lse=True), backward_kernels, "Fa4EagerFunction")


@functools.cache
def graph_function() -> Any:
    """FA4 with autograd inside torch.compile's graphs: the same Function over the ops without autograd kernels,
    which AOTAutograd records (forward graph: fa4_fwd_raw; backward graph: fa4_bwd). attention()'s compiled path,
    not an API: under torch.func transforms dynamo drops its backward (zero gradients, no error; found in review),
    and torch.export keeps no Python Function (export records fa4_fwd instead: `exporting()`)."""
    o = ops()
    return _function(o.fa4_fwd_raw, o.fa4_bwd, "Fa4GraphFunction")


def exporting() -> bool:
    """Whether the call is being traced by torch.export (whose program keeps ops, not Python autograd)."""
    import torch

    check = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.6
    return bool(check()) if check is not None else False
