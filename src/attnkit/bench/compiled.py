"""`attnkit bench --compiled`: torch.compile(fullgraph=True) of attention() against the same call eager, side by
side in one run (the compile issue's parity check). Per shape: the eager pick, the kernels the compiled graph
runs with their summed GPU time (torch.profiler), where each call's host time goes (cProfile), and compiled /
eager speed forward and fwd+bwd in both timing modes of bench.timer; on CUDA also the same graph under CUDA
graphs (mode="reduce-overhead": `ratio_cudagraphs`, or the capture's error)
Shapes: the bench suite's whose eager pick is a JIT backend a graph used to lose (FlashAttention-4, flex), or
the ones named with --shape."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from attnkit._io import write_atomic
from attnkit.bench.candidates import PLAIN, Case
from attnkit.bench.shapes import Shape, named, suite
from attnkit.bench.timer import b2b_calls, interleaved, sync_iters, warm, warm_gpu
from attnkit.errors import UsageError, first_line

KERNEL_WORDS = ("attn", "fmha", "flash", "cudnn", "sdpa", "sm90", "flex", "triton")


def kernels(fn: Any) -> dict[str, Any]:
    """One call of `fn` (forward, or forward+backward) under torch.profiler: its attention-looking CUDA kernels,
    every other kernel with its count, and the summed GPU time. Equal GPU time with a slower wall time means the
    gap is host work (wrappers, dispatch), not the graph's kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    attn = sorted({e.key[:120] for e in events if any(w in e.key.lower() for w in KERNEL_WORDS)})[:12]
    other: Counter[str] = Counter()
    for e in events:
        if e.key[:120] not in attn:
            other[e.key[:80]] += e.count
    return {"attention": attn, "other": dict(other),
            "gpu_us": round(sum(e.self_device_time_total for e in events), 1),
            "runtime_api": runtime_api(averages)}


def runtime_api(averages: Any) -> dict[str, int]:
    """The CUDA runtime and driver calls of one profiled call, with their counts (the closing synchronize is one
    of them): a stream synchronize, a memcpy or a cudaMalloc inside the call stalls the GPU's queue, which
    equal kernel time does not show."""
    import re

    import torch

    api = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx; not kernels named cudnn_*, cutlass_*
    return {e.key[:60]: e.count for e in averages
            if e.device_type == torch.autograd.DeviceType.CPU and api.match(e.key) and e.count}


def host_profile(fn: Any, device: str, calls: int = 20, top: int = 12) -> dict[str, Any]:
    """Where the host time of `calls` back-to-back calls goes (cProfile, stopped before the closing sync, so the
    wait for the GPU is not in it): the functions with the most own time, in us a call. Beside equal GPU time
    (kernels()), this names the layer a slower compiled call spends its time in (dynamo's guards, AOTAutograd's
    wrappers, the custom op's dispatch, FA4's launch). cProfile's own cost is in the figures, and weighs more on
    the path with more Python calls: compare layers, not totals."""
    import cProfile
    import pstats

    from attnkit.bench.timer import sync

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync(device)
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    return {"us_per_call": round(st.total_tt / calls * 1e6, 1),  # type: ignore[attr-defined]
            "top_own_us": {f"{Path(f).name}:{line}({name})": round(tt / calls * 1e6, 1)
                           for (f, line, name), (_cc, _nc, tt, _ct, _callers) in rows}}


def host_added(host: dict[str, Any]) -> dict[str, float]:
    """Host time compiling adds to a call (compiled - eager, us a call, from host_profile's totals), for attnkit's
    call and for the plain call in the same race: torch.compile's own cost is what both pay; what attnkit's
    figure has beyond the plain call's is its own. With a sync per call, host time only shows where the kernel is
    shorter than it, which is why a short FA4 kernel loses a ratio that a long SDPA kernel hides."""
    out = {}
    for name, (eager, compiled) in (("attnkit", ("eager", "compiled")), ("plain", ("plain_eager", "plain_compiled"))):
        if eager in host and compiled in host:
            out[name] = round(host[compiled]["us_per_call"] - host[eager]["us_per_call"], 1)
    return out


def replay_counts(fn: Any, calls: int = 5) -> dict[str, int]:
    """What FA4's replay (runtime/backends/fa4_replay.py) did over `calls` steady calls of `fn`, after the timings:
    a compiled FA4 step that replays counts a replay per pass, one on FA4's own path counts `own_path` (its Python
    host path runs every call), one still recording or checking counts those. Nonzero keys only."""
    from attnkit.runtime.backends import fa4_replay

    before = dict(fa4_replay.STATS)
    for _ in range(calls):
        fn()
    return {k: v - before.get(k, 0) for k, v in fa4_replay.STATS.items() if v != before.get(k, 0)}


def compiled_pair(c: Case) -> tuple[Any, Any, Any]:
    """attention() with the case's options, that call compiled (fullgraph), and the plain SDPA call compiled, after a
    dynamo reset: the candidates a compiled-against-eager comparison starts from."""
    import torch

    from attnkit.runtime.attention import attention

    kw = c.kw

    def f(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, **kw)

    torch._dynamo.reset()
    return f, torch.compile(f, fullgraph=True), torch.compile(c.plain, fullgraph=True)


def compare(s: Shape, device: str = "cuda", iters: int = 15, rounds: int = 6) -> dict[str, Any]:
    """One shape: eager and compiled raced side by side; outputs compared (kernels listed on CUDA)."""
    import torch

    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import select

    c = Case(s, device)
    f, compiled, plain_compiled = compiled_pair(c)
    # CUDA graphs (the compile issue's item 4): the same graph replayed, which takes the host out of the call
    graphed = torch.compile(f, fullgraph=True, mode="reduce-overhead") if device == "cuda" else None
    row: dict[str, Any] = {"shape": s.label, "eager_pick": {}, "compile_s": {}, "ms": {}, "ratio": {},
                           "kernels": {}, "max_abs_diff": {}}
    pq, pk, pv = c.padded if s.lengths is not None else (c.q, c.k, c.v)  # the plain call's tensors (padded varlen)
    for ps in ("fwd", "fwdbwd") if s.train else ("fwd",):
        grad = ps == "fwdbwd"
        row["eager_pick"][ps] = select(c.call(grad), probe()).name
        fns = {"eager": lambda: f(c.q, c.k, c.v), "compiled": lambda: compiled(c.q, c.k, c.v)}
        if graphed is not None:
            fns["cudagraphs"] = lambda: graphed(c.q, c.k, c.v)
        if grad:
            fns = {n: c.step(fn, n) for n, fn in fns.items()}
        # the control: the plain SDPA call a user writes, eager and compiled, in the same race. Its ratio is what
        # torch.compile itself costs this call (guards, AOTAutograd's wrappers), with no attnkit code in it
        plain = {"plain_eager": lambda: c.plain(pq, pk, pv), "plain_compiled": lambda: plain_compiled(pq, pk, pv)}
        fns.update({n: c.step(fn, PLAIN) for n, fn in plain.items()} if grad else plain)
        with torch.set_grad_enabled(grad):
            t0 = time.perf_counter()
            outs, errors = warm({"compiled": fns["compiled"]}, device, times=2)
            row["compile_s"][ps] = round(time.perf_counter() - t0, 1)
            _, plain_errors = warm({n: fns[n] for n in ("plain_eager", "plain_compiled")}, device, times=2)
            if plain_errors:  # the control's failure is its own, not the shape's: both halves leave the race
                row.setdefault("control_errors", {}).update({f"{ps} {n}": e for n, e in plain_errors.items()})
                del fns["plain_eager"], fns["plain_compiled"]
            if errors:
                row.setdefault("errors", {})[ps] = errors["compiled"]
                continue
            ref, eager_errors = warm({"eager": fns["eager"]}, device)
            if eager_errors:
                row.setdefault("errors", {})[ps] = f"eager: {eager_errors['eager']}"
                continue
            row["max_abs_diff"][ps] = float((outs["compiled"].detach().float() - ref["eager"].detach().float())
                                            .abs().max())
            if "cudagraphs" in fns:  # its outputs live in the graph's pool until the next replay: one more call,
                _, g_err = warm({"cudagraphs": fns["cudagraphs"]}, device, times=3)  # compared before any other
                try:
                    if g_err:
                        raise RuntimeError(g_err["cudagraphs"])
                    got = fns["cudagraphs"]().detach().float()
                    row.setdefault("cudagraphs_max_abs_diff", {})[ps] = float(
                        (got - ref["eager"].detach().float()).abs().max())
                except Exception as e:  # a capture that fails is this variant's result, not the shape's end
                    row.setdefault("cudagraphs_errors", {})[ps] = f"{type(e).__name__}: {first_line(e)}"
                    del fns["cudagraphs"]
            one = interleaved(fns, device, iters=2)
            fastest = min(one.values())
            calls = b2b_calls(fastest)
            sync = interleaved(fns, device, iters=sync_iters(fastest, iters), seed=1)
            b2b = interleaved(fns, device, iters=rounds, calls=calls, seed=2)
            if device == "cuda":
                try:  # a diagnosis beside the timings: a profiler failure must not cost the shape its row
                    row.setdefault("fa4_replay", {})[ps] = {n: replay_counts(fn) for n, fn in fns.items()}
                    row["kernels"][ps] = {n: kernels(fn) for n, fn in fns.items()}
                    row.setdefault("host", {})[ps] = {n: host_profile(fn, device) for n, fn in fns.items()}
                    row.setdefault("host_added_us", {})[ps] = host_added(row["host"][ps])
                except Exception as e:
                    row.setdefault("diagnosis_errors", {})[ps] = f"{type(e).__name__}: {first_line(e)}"
        row["ms"][ps] = {n: {"sync": round(sync[n] * 1e3, 4), "b2b": round(b2b[n] * 1e3, 4)} for n in fns}
        row["ratio"][ps] = {m: round((sync if m == "sync" else b2b)["eager"] / (sync if m == "sync" else b2b)
                                     ["compiled"], 3) for m in ("sync", "b2b")}
        if "cudagraphs" in fns:
            row.setdefault("ratio_cudagraphs", {})[ps] = {
                m: round(t["eager"] / t["cudagraphs"], 3) for m, t in (("sync", sync), ("b2b", b2b))}
        if "plain_compiled" in fns:  # torch.compile's own ratio on the plain call; and attnkit compiled against
            row.setdefault("ratio_plain", {})[ps] = {  # what a user compiles without attnkit
                m: {"plain_eager_over_compiled": round(t["plain_eager"] / t["plain_compiled"], 3),
                    "plain_compiled_over_attnkit_compiled": round(t["plain_compiled"] / t["compiled"], 3)}
                for m, t in (("sync", sync), ("b2b", b2b))}
    return row


def run_compiled(out: str, only: list[str] | None = None, budget_s: float = 1200.0, say: Any = print) -> int:
    """Every chosen shape (see the module docstring) within `budget_s`; 1 if one is below 0.97 or failed."""
    from attnkit.bench.run import environment, measuring_device
    from attnkit.runtime.backends.flex import for_measurement
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import select

    if measuring_device("bench --compiled") != "cuda":
        raise UsageError("--compiled: needs a CUDA GPU (it compares compiled against eager kernels)")
    for_measurement()
    shapes = named(suite(False), only)
    if not only:
        p = probe()
        shapes = [s for s in shapes if any(select(Case(s, "cuda").call(g), p).compiles
                                           for g in ((False, True) if s.train else (False,)))]
    warm_gpu()
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"what": "torch.compile(fullgraph=True) of attnkit.attention() vs the same call eager, "
                                   "side by side (bench.timer: sync per call, and back to back)",
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "environment": environment(), "rows": rows}
    t0 = time.perf_counter()
    for s in shapes:
        if time.perf_counter() - t0 > budget_s:
            doc.setdefault("left_by_budget", []).append(s.label)
            continue
        rows.append(compare(s))
        say(f"compiled {s.label}: {json.dumps(rows[-1]['ratio'])} eager pick {rows[-1]['eager_pick']}")
        write_atomic(Path(out), json.dumps(doc, indent=1, default=str))
    ratios = [x for r in rows for modes in r["ratio"].values() for x in modes.values()]
    doc["summary"] = {"shapes": len(rows), "min_ratio": min(ratios, default=None),
                      "below_0.97": [f"{r['shape']} {ps} {m}" for r in rows for ps, modes in r["ratio"].items()
                                     for m, x in modes.items() if x < 0.97],
                      "failed": [r["shape"] for r in rows if r.get("errors")]}
    write_atomic(Path(out), json.dumps(doc, indent=1, default=str))
    say(f"summary: {json.dumps(doc['summary'])}")
    return 1 if doc["summary"]["below_0.97"] or doc["summary"]["failed"] else 0
