"""FlashAttention-4 without its Python on every call: each call signature's launches recorded once, then replayed.

Why: `flash_attn.cute.interface._flash_attn_fwd` (4.0.0b36) runs ~1300 lines of Python before its one kernel
launch (config heuristics, a compile key, a softcap score_mod re-created and hashed through `inspect.getsource`
on every call). On the H200 that is ~100-130 us of host time a call (docs/results/2026-12-02-h200-fa4-path-probe.json:
a windowed decode 130 us back to back, 260 us with a sync, for ~120 us of GPU work), so per call with a sync the
plain SDPA call beat FA4's faster kernel on prefill and decode (validate 2026-12-02: 0.75-0.80).

How, for one signature (shapes, strides, alignment, dtypes, device, every scalar argument):
1. record: the first call that compiles nothing runs `_flash_attn_fwd` itself, with every JIT cache of the interface module watched
   (which compiled functions it calls, with which arguments) and every aten op it runs logged (TorchDispatchMode).
   A plan exists only if that call launched exactly ONE compiled function, ran no aten op but allocations, detach
   and views, and passed that function nothing but the call's own tensors (q, k, v, cu_seqlens), the outputs it
   returned (out, lse: contiguous, allocated fresh) and tensor-free constants. Anything else (split-KV and its
   combine kernel, scheduler metadata, a clone of a misaligned input, a zero-fill) leaves the signature on FA4's
   own path for good.
2. verify: the next call runs both FA4's own path and the plan, and keeps the plan only if the outputs are
   bitwise equal (the forward kernels are deterministic).
3. replay: later calls allocate out/lse and call the compiled function directly.
Training calls use the same forward plans and replay FA4's backward too (`backward`, below: several launches and
FA4's own work buffers, verified within rounding); both are wired by fa4_ops (its ops, and `eager_function` for
eager autograd). Under CUDA-graph capture a plan is only replayed, never recorded or verified (verification
synchronises). `ATTNKIT_FA4_REPLAY=0` turns both off: FA4's own functions then run every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from attnkit.errors import first_line, out_of_memory
from attnkit.runtime import loaders

ENV = "ATTNKIT_FA4_REPLAY"
MAX_PLANS = 512  # signatures kept (LRU); a plan holds no tensor, only the compiled function and constants
# aten ops FA4's host path may run for a plan to be replayable: allocations, detach, views (no data written)
_ALLOWED_OPS = frozenset({
    "empty.memory_format", "empty_strided.default", "detach.default", "alias.default", "view.default",
    "_unsafe_view.default", "transpose.int", "permute.default", "t.default", "unsqueeze.default",
    "squeeze.dim", "squeeze.default", "select.int", "slice.Tensor", "as_strided.default", "expand.default",
    "empty_like.default",
})
_SLOTS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "out", "lse")


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclasses.dataclass
class Plan:
    """One recorded launch: the compiled function, its arguments as slots (a name in _SLOTS) or constants."""

    fn: Any
    args: tuple[tuple[str, Any], ...]  # ("slot", name) or ("const", value)
    out_shape: tuple[int, ...]
    out_dtype: Any
    lse_shape: tuple[int, ...] | None
    verified: bool = False

    def run(self, tensors: dict[str, Any]) -> tuple[Any, Any]:
        import torch

        q = tensors["q"]
        tensors["out"] = out = torch.empty(self.out_shape, dtype=self.out_dtype, device=q.device)
        lse = None
        if self.lse_shape is not None:
            tensors["lse"] = lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.fn(*[tensors[v] if kind == "slot" else v for kind, v in self.args])
        return out, lse


class Refused(Exception):
    """Why a signature stays on FA4's own path (kept for `stats()`)."""


_LOCK = threading.Lock()
_PLANS: OrderedDict[tuple, Any] = OrderedDict()  # a str: the reason a signature has no plan
# signatures seen once, on FA4's own path: a signature is recorded on its second call, so calls whose signature
# never comes again (packed batches with new lengths each step) pay no recording
_SEEN: OrderedDict[tuple, None] = OrderedDict()
_COMPILES: dict[tuple, int] = {}  # signatures whose recording call compiled, and how often
STATS = {"replayed": 0, "recorded": 0, "verified": 0, "refused": 0, "own_path": 0, "bwd_replayed": 0,
         "bwd_verified": 0}  # replayed/verified count both passes; the bwd_ keys the backward's alone


def stats() -> dict[str, Any]:
    """Counts, and why each refused signature was refused (doctor, the probe)."""
    with _LOCK:
        reasons = [v for v in _PLANS.values() if isinstance(v, str)]
    return {**STATS, "plans": len(_PLANS), "refusals": sorted(set(reasons))[:20]}


def clear() -> None:
    with _LOCK:
        _PLANS.clear()
        _SEEN.clear()
        _COMPILES.clear()
        for k in STATS:
            STATS[k] = 0


def _sig(t: Any) -> Any:
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16, t.requires_grad)


def _aliases(*ts: Any) -> tuple[int, ...]:
    """Which of a call's tensors are one another (k is v, one cu_seqlens for both): for each, the index of the
    first with the same data pointer. Part of the key: a plan maps a launch's arguments to the call's tensors by
    pointer, so one recorded with k is v would hand k where v belongs to a call with two tensors."""
    ptrs = [None if t is None else t.data_ptr() for t in ts]
    return tuple(ptrs.index(x) if x is not None else -1 for x in ptrs)


def _lookup(key: tuple) -> Any:
    """The key's plan (kept fresh in the LRU) or the reason it has none; `_FIRST` for a signature never seen
    (FA4's own path, noted as seen); None for its second call, which records."""
    plan = _PLANS.get(key)
    if plan is not None:
        if type(plan) is not str:
            with _LOCK:  # stats() iterates _PLANS under the lock: a move_to_end outside it breaks that iteration
                if key in _PLANS:
                    _PLANS.move_to_end(key)
        return plan
    if key in _SEEN:
        return None
    with _LOCK:
        _SEEN[key] = None
        while len(_SEEN) > 4 * MAX_PLANS:
            _SEEN.popitem(last=False)
    return _FIRST


_FIRST = "first call of this signature: FlashAttention-4's own path"  # _lookup's answer for a first call


def forward(q: Any, k: Any, v: Any, *, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, softmax_scale: float,
            causal: bool, window_size_left: int | None, window_size_right: int | None, softcap: float = 0.0,
            return_lse: bool = False) -> tuple[Any, Any]:
    """`_flash_attn_fwd(...)[:2]` (out, lse), through a replayed plan where the signature has one."""
    replay = enabled()
    if replay:  # the hot path builds the key and runs the plan, nothing else
        key = (_sig(q), _sig(k), _sig(v), _sig(cu_seqlens_q), _sig(cu_seqlens_k), _aliases(
               q, k, v, cu_seqlens_q, cu_seqlens_k), max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               window_size_left, window_size_right, softcap, return_lse)
        plan = _lookup(key)
        tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        if type(plan) is Plan and plan.verified:
            STATS["replayed"] += 1
            return plan.run(tensors)
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
              window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap,
              return_lse=return_lse)
    if not replay:
        return _own(q, k, v, kw)
    if isinstance(plan, str) or _capturing(q):
        STATS["own_path"] += 1
        return _own(q, k, v, kw)
    if plan is None:
        return _record(key, q, k, v, kw, tensors)
    return _verify(key, plan, q, k, v, kw, tensors)


def _own(q: Any, k: Any, v: Any, kw: dict[str, Any]) -> tuple[Any, Any]:
    loaders.load_fa4()
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(q, k, v, **kw)
    return out, lse


def _capturing(q: Any) -> bool:
    import torch

    return bool(q.is_cuda and torch.cuda.is_current_stream_capturing())


def _keep(key: tuple, value: Any) -> None:  # a Plan, a StepPlan, or why a signature has none
    with _LOCK:
        _PLANS[key] = value
        _PLANS.move_to_end(key)
        while len(_PLANS) > MAX_PLANS:
            _PLANS.popitem(last=False)


def _verify(key: tuple, plan: Plan, q: Any, k: Any, v: Any, kw: dict[str, Any],
            tensors: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    out, lse = _own(q, k, v, kw)

    def same() -> bool:
        r_out, r_lse = plan.run(dict(tensors))
        return torch.equal(out, r_out) and ((lse is None and r_lse is None) or
                                            (lse is not None and r_lse is not None and torch.equal(lse, r_lse)))
    _judge(key, plan, same, "replayed output differs from FlashAttention-4's own call")
    return out, lse


def _judge(key: tuple, plan: Any, same: Any, why: str, backward: bool = False) -> None:
    """Verification's verdict on a plan: `same()` ran it beside FA4's own call. A plan that cannot run is no plan;
    one that ran short of memory is tried again on the signature's next call."""
    try:
        ok = bool(same())
    except Exception as exc:
        if out_of_memory(exc):
            return
        ok, why = False, f"replay raised {type(exc).__name__}: {first_line(exc, 160)}"
    if ok:
        plan.verified = True
        STATS["verified"] += 1
        STATS["bwd_verified"] += backward
    else:
        STATS["refused"] += 1
        _keep(key, why)


class _Watch:
    """A JIT cache stand-in for one recording call: lookups delegate; each compiled function it hands out is
    wrapped to note its call and arguments."""

    def __init__(self, name: str, cache: Any, calls: list, compiled: list) -> None:
        self._name, self._cache, self._calls, self._compiled = name, cache, calls, compiled
        self._thread = threading.get_ident()  # the caches are module state: other threads' calls are not noted

    def __contains__(self, key: Any) -> bool:
        return key in self._cache

    def __setitem__(self, key: Any, fn: Any) -> None:
        if threading.get_ident() == self._thread:
            self._compiled.append(self._name)
        self._cache[key] = fn

    def __getitem__(self, key: Any) -> Any:
        fn = self._cache[key]
        if threading.get_ident() != self._thread:
            return fn
        calls, name = self._calls, self._name

        def noted(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, fn, args, kwargs))
            return fn(*args, **kwargs)
        return noted

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._cache, attr)


def _jit_owners(interface: Any) -> list[Any]:
    return [f for f in vars(interface).values() if callable(f) and hasattr(f, "compile_cache")]


@contextlib.contextmanager
def _watched(interface: Any, calls: list, compiled: list, mode: Any) -> Iterator[None]:
    """For one call of FA4's own host path: every JIT cache of its interface module watched (`_Watch`; one
    recording at a time, since the caches are module state) and `mode`, a TorchDispatchMode, logging aten ops."""
    with _LOCK:
        saved = [(f, f.compile_cache) for f in _jit_owners(interface)]
        try:
            for f, cache in saved:
                f.compile_cache = _Watch(f.__name__, cache, calls, compiled)
            with mode:
                yield
        finally:
            for f, cache in saved:
                f.compile_cache = cache


def _compiled_again(key: tuple, what: str) -> None:
    """A recording call that compiled records nothing; a signature whose third recording call compiled is refused."""
    _COMPILES[key] = _COMPILES.get(key, 0) + 1
    if _COMPILES[key] >= 3:
        STATS["refused"] += 1
        _keep(key, f"{what} compiled on each of 3 calls")


def _record(key: tuple, q: Any, k: Any, v: Any, kw: dict[str, Any], tensors: dict[str, Any]) -> tuple[Any, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    loaders.load_fa4()
    from flash_attn.cute import interface

    ops: set[str] = set()

    class OpLog(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            ops.add(str(func.overloadpacket.__name__) + "." + str(func._overloadname))
            return func(*args, **(kwargs or {}))

    calls: list = []
    compiled: list = []
    with _watched(interface, calls, compiled, OpLog()):
        out, lse, *_ = interface._flash_attn_fwd(q, k, v, **kw)
    if compiled:  # a call that compiles (and may run ops of its own): the next call records instead
        _compiled_again(key, "FlashAttention-4")
        return out, lse
    STATS["recorded"] += 1
    try:
        plan = _plan(calls, ops, {**tensors, "out": out, "lse": lse})
    except Refused as why:
        STATS["refused"] += 1
        _keep(key, str(why))
    else:
        _keep(key, plan)
    return out, lse


def _same_tensor(a: Any, b: Any) -> bool:
    return (a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _tensor_free(x: Any, depth: int = 0) -> bool:
    import torch

    if depth > 4 or torch.is_tensor(x):
        return False
    if x is None or isinstance(x, (bool, int, float, str)):
        return True
    if isinstance(x, (tuple, list)):
        return all(_tensor_free(y, depth + 1) for y in x)
    if dataclasses.is_dataclass(x):
        return all(_tensor_free(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x))
    return not any(torch.is_tensor(y) for y in getattr(x, "__dict__", {}).values())


def _arg_spec(name: str, args: tuple[Any, ...], tensors: dict[str, Any], slots: tuple[str, ...],
              buf_of: Any = lambda t: None) -> list[tuple[str, Any]]:
    """A recorded launch's arguments as data: ("buf", i) for an allocation of the recorded call (`buf_of`),
    ("slot", name) for one of the call's own tensors, ("const", value) for a tensor-free constant; Refused else."""
    import torch

    spec: list[tuple[str, Any]] = []
    for j, a in enumerate(args):
        if torch.is_tensor(a):
            i = buf_of(a)
            if i is not None:
                spec.append(("buf", i))
                continue
            hit = next((s for s in slots if tensors.get(s) is not None and _same_tensor(a, tensors[s])), None)
            if hit is None:
                raise Refused(f"{name}: argument {j} is a tensor FlashAttention-4 derived from the call")
            spec.append(("slot", hit))
        elif _tensor_free(a):
            spec.append(("const", a))
        else:
            raise Refused(f"{name}: argument {j} ({type(a).__name__}) holds tensors")
    return spec


def _plan(calls: list, ops: set[str], tensors: dict[str, Any]) -> Plan:
    """The plan for one recorded call, or Refused with the reason."""
    if len(calls) != 1:
        raise Refused(f"{len(calls)} compiled launches in one call ({', '.join(c[0] for c in calls) or 'none'}): "
                      "only a single-launch forward is replayed")
    name, fn, args, kwargs = calls[0]
    if kwargs:
        raise Refused(f"{name}: keyword arguments to the compiled function")
    extra = sorted(ops - _ALLOWED_OPS)
    if extra:
        raise Refused(f"FlashAttention-4's host path ran {', '.join(extra[:4])}: only allocations and views are replayed")
    out, lse = tensors["out"], tensors["lse"]
    for t, what in ((out, "out"), (lse, "lse")):
        if t is not None and not t.is_contiguous():
            raise Refused(f"{what} is not contiguous")
    slots = _arg_spec(name, args, tensors, _SLOTS)
    if ("slot", "out") not in slots or (lse is not None and ("slot", "lse") not in slots):
        raise Refused(f"{name}: the kernel does not write the returned out/lse (a split-KV or staged forward)")
    return Plan(fn=fn, args=tuple(slots), out_shape=tuple(out.shape), out_dtype=out.dtype,
                lse_shape=None if lse is None else tuple(lse.shape))


# -- the backward: several launches and FA4's own work buffers ---------------------------------------------------
# FA4's `_flash_attn_bwd` (4.0.0b36) allocates dq, dk, dv and float32 work buffers (dq_accum, dpsum, lse_log2; for
# GQA zero-filled dk/dv accumulators; semaphores when deterministic), then launches a preprocess kernel, the main
# kernel and one to three postprocess kernels, each compiled once per configuration; its Python decides all of it
# from shapes and flags alone. A backward plan is that sequence as data: allocations (shape, strides, dtype, a fill
# value where FA4 zero- or value-filled one), launches whose tensor arguments are the call's own tensors or those
# allocations, and which allocations are returned. dq (and GQA's dk/dv) are summed with atomics in float32, so two
# runs of the same call may differ in the last bit: a plan is verified against FA4's own call within rounding
# (`_close`), not bitwise; a wrong plan (a buffer missed, an argument swapped) is off by far more.

_ALLOC_OPS = frozenset({"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
                        "new_empty_strided.default"})
_ZERO_ALLOC_OPS = frozenset({"zeros.default", "zeros_like.default", "new_zeros.default"})
_FILL_OPS = frozenset({"zero_.default", "fill_.Scalar"})
_VIEW_OPS = _ALLOWED_OPS - _ALLOC_OPS
_BWD_SLOTS = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k")


@dataclasses.dataclass
class StepPlan:
    """A recorded backward: ("alloc", shape, stride, dtype) | ("fill", buffer, value) | ("launch", name, fn, args)
    steps in FA4's order (args: ("slot", name), ("buf", index) or ("const", value)); `outputs` are buffer indices."""

    steps: tuple[tuple[Any, ...], ...]
    outputs: tuple[int, ...]
    verified: bool = False

    def run(self, tensors: dict[str, Any], poison: bool = False) -> tuple[Any, ...]:
        """The recorded steps on this call's tensors. `poison` (verification): every allocation FA4 did not fill
        starts as NaN (or -1), so a launch the plan missed shows, even where the caching allocator hands back
        the blocks FA4's own call just freed with the right values still in them."""
        import torch

        device = tensors["q"].device
        bufs: list[Any] = []
        filled = {st[1] for st in self.steps if st[0] == "fill"} if poison else set()
        for st in self.steps:
            if st[0] == "alloc":
                bufs.append(torch.empty_strided(st[1], st[2], dtype=st[3], device=device))
                if poison and len(bufs) - 1 not in filled:
                    bufs[-1].fill_(float("nan") if bufs[-1].is_floating_point() else -1)
            elif st[0] == "fill":
                bufs[st[1]].fill_(st[2])
            else:
                st[2](*[tensors[v] if kind == "slot" else bufs[v] if kind == "buf" else v for kind, v in st[3]])
        return tuple(bufs[i] for i in self.outputs)


def backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float, causal: bool,
             softcap: float, window_size_left: int | None, window_size_right: int | None, cu_seqlens_q: Any = None,
             cu_seqlens_k: Any = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
             deterministic: bool = False) -> tuple[Any, Any, Any]:
    """`_flash_attn_bwd(...)[:3]` (dq, dk, dv), through a replayed plan where the signature has one. `dout` must be
    contiguous (FlashAttnFunc's backward gets it so from attnkit: fa4_ops.backward_kernels)."""
    replay = enabled()
    if replay:  # the hot path builds the key and runs the plan, nothing else
        key = ("bwd", _sig(dout), _sig(q), _sig(k), _sig(v), _sig(out), _sig(lse), _sig(cu_seqlens_q),
               _sig(cu_seqlens_k), _aliases(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), max_seqlen_q,
               max_seqlen_k, softmax_scale, causal, softcap, window_size_left, window_size_right, deterministic)
        tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "cu_seqlens_q": cu_seqlens_q,
                   "cu_seqlens_k": cu_seqlens_k}
        plan = _lookup(key)
        if type(plan) is StepPlan and plan.verified:
            STATS["replayed"] += 1
            STATS["bwd_replayed"] += 1
            return plan.run(tensors)  # type: ignore[return-value]
    kw = dict(window_size_left=window_size_left, window_size_right=window_size_right, cu_seqlens_q=cu_seqlens_q,
              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
              deterministic=deterministic)
    args = (q, k, v, out, dout, lse, softmax_scale, causal, softcap)
    if not replay:
        return _own_bwd(args, kw)
    if isinstance(plan, str) or _capturing(q):
        STATS["own_path"] += 1
        return _own_bwd(args, kw)
    if plan is None:
        return _record_bwd(key, args, kw, tensors)
    return _verify_bwd(key, plan, args, kw, tensors)  # type: ignore[arg-type]


def _own_bwd(args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, Any, Any]:
    loaders.load_fa4()
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(*args, **kw)[:3]
    return dq, dk, dv


_CHUNK = 1 << 24  # elements compared at a time: verification allocates float32 temporaries of this size only


def _close(a: Any, b: Any) -> bool:
    """Equal within the rounding that float32 atomics in another order leave after the cast to half precision:
    each element within 1/64 of itself plus 1e-3 of the largest (a plan that missed a buffer is off by far more),
    and finite exactly where the other is."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    fa, fb = a.reshape(-1), b.reshape(-1)
    finite = torch.isfinite(fb)
    top = float(torch.where(finite, fb, 0).abs().max()) if fb.numel() else 0.0
    for x, y in zip(fa.split(_CHUNK), fb.split(_CHUNK), strict=True):
        x, y = x.float(), y.float()
        fin = torch.isfinite(y)
        if not bool(torch.isfinite(x).eq(fin).all()):
            return False
        x, y = torch.where(fin, x, 0.0), torch.where(fin, y, 0.0)
        if not bool(((x - y).abs() <= y.abs() / 64 + 1e-3 * top + 1e-6).all()):
            return False
    return True


def _verify_bwd(key: tuple, plan: StepPlan, args: tuple[Any, ...], kw: dict[str, Any],
                tensors: dict[str, Any]) -> tuple[Any, Any, Any]:
    own = _own_bwd(args, kw)

    def same() -> bool:
        mine = plan.run(dict(tensors), poison=True)
        return len(mine) == 3 and all(_close(m, o) for m, o in zip(mine, own, strict=True))
    _judge(key, plan, same, "replayed gradients differ from FlashAttention-4's own backward beyond rounding",
           backward=True)
    return own


def _record_bwd(key: tuple, args: tuple[Any, ...], kw: dict[str, Any],
                tensors: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    loaders.load_fa4()
    from flash_attn.cute import interface

    events: list = []  # in FA4's order: ("alloc", tensor) / ("fill", tensor, value) / ("other", op) / launches
    bufs: list = []

    class BufLog(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, a: Any = (), kwargs: Any = None) -> Any:
            name = str(func.overloadpacket.__name__) + "." + str(func._overloadname)
            result = func(*a, **(kwargs or {}))
            if name in _ALLOC_OPS or name in _ZERO_ALLOC_OPS:
                events.append(("alloc", result))
                if name in _ZERO_ALLOC_OPS:
                    events.append(("fill", result, 0))
            elif name in _FILL_OPS:
                events.append(("fill", a[0], 0 if name == "zero_.default" else a[1]))
            elif name not in _VIEW_OPS:
                events.append(("other", name))
            return result

    compiled: list = []
    with _watched(interface, events, compiled, BufLog()):
        dq, dk, dv = interface._flash_attn_bwd(*args, **kw)[:3]
    if compiled:  # a call that compiles: the next one records
        _compiled_again(key, "FlashAttention-4's backward")
        return dq, dk, dv
    STATS["recorded"] += 1
    try:
        plan = _step_plan(events, bufs, tensors, (dq, dk, dv), torch)
    except Refused as why:
        STATS["refused"] += 1
        _keep(key, str(why))
    else:
        _keep(key, plan)
    return dq, dk, dv


def _step_plan(events: list, bufs: list, tensors: dict[str, Any], outputs: tuple[Any, ...], torch: Any) -> StepPlan:
    """The backward plan for one recorded call, or Refused with the reason."""
    def buf_of(t: Any) -> int | None:
        return next((i for i, b in enumerate(bufs) if b is t or _same_tensor(b, t)), None)

    steps: list[tuple[Any, ...]] = []
    launches = 0
    for ev in events:
        if ev[0] == "alloc":
            t = ev[1]
            if not torch.is_tensor(t) or t.device != tensors["q"].device:
                raise Refused("an allocation that is not one tensor on the call's device")
            bufs.append(t)
            steps.append(("alloc", tuple(t.shape), tuple(t.stride()), t.dtype))
        elif ev[0] == "fill":
            i = buf_of(ev[1])
            if i is None:
                raise Refused("FlashAttention-4's backward filled a tensor it did not allocate")
            if not isinstance(ev[2], (int, float)) or isinstance(ev[2], bool):
                raise Refused("a fill with a value that is not a number")
            steps.append(("fill", i, ev[2]))
        elif ev[0] == "other":
            raise Refused(f"FlashAttention-4's backward ran {ev[1]}: only allocations, fills and views are replayed")
        else:
            name, fn, args, kwargs = ev
            if kwargs:
                raise Refused(f"{name}: keyword arguments to the compiled function")
            steps.append(("launch", name, fn, tuple(_arg_spec(name, args, tensors, _BWD_SLOTS, buf_of))))
            launches += 1
    if not launches:
        raise Refused("no compiled launch in FlashAttention-4's backward (an empty input?)")
    idx = []
    for t in outputs:
        i = buf_of(t)
        if i is None:
            raise Refused("a gradient FlashAttention-4 returned is not one of its allocations")
        idx.append(i)
    return StepPlan(steps=tuple(steps), outputs=tuple(idx))
