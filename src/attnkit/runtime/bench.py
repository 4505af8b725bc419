"""`attnkit bench`: every available backend side by side in one run, per shape, forward and forward+backward,
against attnkit's selection, torch SDPA's own default and the best (oracle); dispatch overhead; packed
varlen vs padded. Ratios are measured in one process on one GPU, so they compare like with like."""

from __future__ import annotations

import datetime as _dt
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnkit._io import write_atomic

ITERS = 25
MATH_MAX_SCORES = 1 << 28  # sdpa_math materialises B*H*Sq*Sk scores: bench it only where that is small


@dataclass(frozen=True)
class Shape:
    label: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = True
    backward: bool = True


def suite(quick: bool) -> list[Shape]:
    if quick:  # CPU sanity: tiny shapes
        return [Shape("tiny fp32", 2, 4, 4, 128, 128, 64, "float32"),
                Shape("tiny GQA fp32", 2, 8, 2, 128, 128, 64, "float32"),
                Shape("tiny decode fp32", 4, 8, 2, 1, 256, 64, "float32", causal=False, backward=False)]
    return [
        Shape("S4096 D128", 8, 16, 16, 4096, 4096, 128, causal=False),
        Shape("S4096 D128 causal", 8, 16, 16, 4096, 4096, 128),
        Shape("S1024 D64 causal", 32, 32, 32, 1024, 1024, 64),
        Shape("S16384 D128 causal", 2, 32, 32, 16384, 16384, 128),
        Shape("fp16 S2048 D128 causal", 8, 16, 16, 2048, 2048, 128, "float16"),
        Shape("GQA 32/8 S4096 D128 causal", 8, 32, 8, 4096, 4096, 128),
        Shape("decode Sq1 Sk4096 GQA", 64, 32, 8, 1, 4096, 128, causal=False, backward=False),
        Shape("D96 S2048 causal", 8, 16, 16, 2048, 2048, 96),
        Shape("D256 S2048 causal", 4, 16, 16, 2048, 2048, 256),
        Shape("D64 S2048", 16, 16, 16, 2048, 2048, 64, causal=False),
        Shape("fp32 S2048 D64 causal", 4, 16, 16, 2048, 2048, 64, "float32"),
    ]


def attn_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs (two matmuls); causal counts only the visible half when sq == sk."""
    f = 4.0 * batch * heads * sq * sk * d
    if causal and sq == sk:
        f /= 2
    return f


def _no_grad(fn: Any) -> Any:
    def run() -> Any:
        import torch

        with torch.no_grad():
            return fn()
    return run


def interleaved(runs: dict[str, Any], device: str, iters: int = ITERS, warmup: int = 2
                ) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds per candidate, measured round-robin: every iteration times each candidate once, in a
    rotated order. The H200's clocks drift by ~13% within seconds under load (measured: one cuDNN kernel
    6.5 ms cold, 7.1 ms warm, same binary), so candidates timed in separate blocks compare clock states,
    not kernels; interleaving gives every candidate the same clocks."""
    import torch

    errors: dict[str, str] = {}
    live = dict(runs)
    for name, fn in list(live.items()):
        try:
            for _ in range(warmup):
                fn()
        except Exception as exc:  # a kernel refusing a shape at run time is a result, not a crash
            errors[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            del live[name]
        finally:
            if device == "cuda":
                torch.cuda.synchronize()
    samples: dict[str, list[float]] = {n: [] for n in live}
    names = list(live)
    shuffle = random.Random(0).shuffle
    for _ in range(iters):
        # a fresh order every iteration: a rotation keeps each candidate behind the same predecessor, and a
        # kernel that runs right after a slow, low-power one gets the power headroom (measured: SDPA's
        # default 604 TFLOP/s vs the identical cuDNN kernel 540 at S16384 causal, 2026-11-30)
        order = list(names)
        shuffle(order)
        if device == "cuda":
            marks = []
            for n in order:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                live[n]()
                b.record()
                marks.append((n, a, b))
            torch.cuda.synchronize()
            for n, a, b in marks:
                samples[n].append(a.elapsed_time(b) / 1e3)
        else:
            for n in order:
                t0 = time.perf_counter()
                live[n]()
                samples[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in samples.items()}, errors



def _tensors(s: Shape, device: str, grad: bool) -> tuple[Any, Any, Any]:
    import torch

    dt = getattr(torch, s.dtype)
    q = torch.randn(s.batch, s.seqlen_q, s.heads, s.head_dim, device=device, dtype=dt, requires_grad=grad)
    k = torch.randn(s.batch, s.seqlen_k, s.kv_heads, s.head_dim, device=device, dtype=dt, requires_grad=grad)
    v = torch.randn(s.batch, s.seqlen_k, s.kv_heads, s.head_dim, device=device, dtype=dt, requires_grad=grad)
    return q, k, v


def _sdpa_default(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """torch's own pick: plain F.scaled_dot_product_attention, no backend forced."""
    import torch.nn.functional as F

    gqa = k.shape[2] != q.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, enable_gqa=gqa)
    return o.transpose(1, 2)


def bench_shape(s: Shape, device: str) -> dict[str, Any]:
    import torch

    from attnkit.runtime.attention import attention
    from attnkit.runtime.backends import REGISTRY, Params
    from attnkit.runtime.call import make_call
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import SELECTOR

    p = probe()
    q, k, v = _tensors(s, device, grad=s.backward)
    call = make_call(q, k, v, causal=s.causal, dropout_p=0.0, window=None, alibi_slopes=None, attn_bias=None,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
    params = Params(scale=1.0 / math.sqrt(s.head_dim), dropout_p=0.0, window=None)
    flops = attn_flops(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal)
    g = torch.randn(s.batch, s.seqlen_q, s.heads, s.head_dim, device=device, dtype=q.dtype)

    def fb(run: Any) -> Any:
        def step() -> None:
            q.grad = k.grad = v.grad = None
            run().backward(g)
        return step

    runs: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for name, b in REGISTRY.items():
        why = b.check(call, p)
        if name == "sdpa_math" and s.batch * s.heads * s.seqlen_q * s.seqlen_k > MATH_MAX_SCORES:
            why = [*why, "reference kernel: materialises the score matrix, too large to bench here"]
        if why:
            results[name] = {"skipped": "; ".join(why)}
        else:
            runs[name] = lambda b=b: b.run(q, k, v, call, params)
    runs["sdpa_default"] = lambda: _sdpa_default(q, k, v, s.causal)
    runs["attnkit"] = lambda: attention(q, k, v, causal=s.causal)
    fwd_runs = {n: _no_grad(r) for n, r in runs.items()}
    fwd, errors = interleaved(fwd_runs, device)
    times: dict[str, dict[str, float]] = {n: {"fwd": t} for n, t in fwd.items()}
    if s.backward:
        bwd, more = interleaved({n: fb(r) for n, r in runs.items() if n in fwd}, device)
        errors.update(more)
        for n in list(times):
            if n in bwd:
                times[n]["fwdbwd"] = bwd[n]
            else:
                del times[n]
    for n, err in errors.items():
        results[n] = {"error": err}
    for name, best in times.items():
        res: dict[str, Any] = {"fwd_ms": best["fwd"] * 1e3, "fwd_tflops": flops / best["fwd"] / 1e12}
        if "fwdbwd" in best:
            res.update(fwdbwd_ms=best["fwdbwd"] * 1e3, fwdbwd_tflops=3.5 * flops / best["fwdbwd"] / 1e12)
        results[name] = res
    selected = SELECTOR.select(call, p).name
    metric = "fwdbwd_tflops" if s.backward else "fwd_tflops"
    timed = {n: r[metric] for n, r in results.items() if metric in r and n not in ("attnkit", "sdpa_default")}
    oracle = max(timed, key=lambda n: timed[n]) if timed else None
    out: dict[str, Any] = {"shape": s.__dict__, "call": call.describe(), "metric": metric, "selected": selected,
                           "oracle": oracle, "results": results}
    sel = results["attnkit"].get(metric)
    if sel and oracle:
        out["selected_over_oracle"] = sel / timed[oracle]
    if sel and metric in results["sdpa_default"]:
        out["selected_over_sdpa_default"] = sel / results["sdpa_default"][metric]
    # the same two numbers forward-only, for training shapes
    if s.backward:
        f_t = {n: r["fwd_tflops"] for n, r in results.items() if "fwd_tflops" in r and n not in ("attnkit", "sdpa_default")}
        if f_t and "fwd_tflops" in results["attnkit"]:
            out["fwd_selected_over_oracle"] = results["attnkit"]["fwd_tflops"] / max(f_t.values())
    return out


def dispatch_overhead(device: str, n: int = 2000) -> dict[str, Any]:
    """Microseconds attention() adds per call over calling the selected backend's run() directly,
    on a tiny shape so kernel time does not hide it; host-side timing of back-to-back calls."""
    import torch

    from attnkit.runtime.attention import attention
    from attnkit.runtime.backends import Params
    from attnkit.runtime.call import make_call
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import SELECTOR

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 16, 2, 64, device=device, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)
    call = make_call(q, k, v, causal=True, dropout_p=0.0, window=None, alibi_slopes=None, attn_bias=None,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
    b = SELECTOR.select(call, probe())
    params = Params(scale=1 / 8, dropout_p=0.0, window=None)

    def loop(fn: Any, calls: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    direct = lambda: b.run(q, k, v, call, params)  # noqa: E731
    via = lambda: attention(q, k, v, causal=True, softmax_scale=1 / 8)  # noqa: E731
    with torch.no_grad():
        loop(direct, 200)
        loop(via, 200)
        rounds = []
        block = max(50, n // 10)
        for i in range(21):  # short alternating blocks, order flipped each round; median difference
            if i % 2 == 0:
                a = loop(direct, block)
                c = loop(via, block)
            else:
                c = loop(via, block)
                a = loop(direct, block)
            rounds.append((c - a, a, c))
        # the wrapper alone: attention() with its cached backend swapped for a no-op (host cost only)
        from attnkit.runtime.attention import _FAST

        class _Noop:
            name = "noop"

            def run(self, *args: Any) -> None:
                return None

        saved = dict(_FAST)
        for key, (_, c, prm) in saved.items():
            _FAST[key] = (_Noop(), c, prm)  # type: ignore[assignment]
        try:
            wrapper_us = min(loop(via, n) for _ in range(5))
        finally:
            _FAST.clear()
            _FAST.update(saved)
    rounds.sort()
    mid = rounds[len(rounds) // 2]
    return {"backend": b.name, "overhead_us": mid[0], "direct_us": mid[1], "attention_us": mid[2],
            "wrapper_only_us": wrapper_us, "calls_per_block": block, "rounds": len(rounds)}


def varlen_vs_padded(device: str, quick: bool) -> dict[str, Any]:
    """Packed varlen vs padded (batch, max_seqlen) forward+backward at ~50% padding."""
    import torch

    from attnkit.runtime.attention import attention, pack

    gen = torch.Generator().manual_seed(0)
    if quick:
        b, s, h, d, dt = 4, 128, 4, 32, torch.float32
    else:
        b, s, h, d, dt = 16, 4096, 16, 128, torch.bfloat16
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    lengths[0] = s  # one full-length sequence, so max_seqlen == s
    pad_frac = 1.0 - float(lengths.sum()) / (b * s)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dt) for _ in range(3))
    qp, _, cu, mx = pack(q, lengths.to(device))
    kp, _, _, _ = pack(k, lengths.to(device))
    vp, _, _, _ = pack(v, lengths.to(device))
    for t in (q, k, v, qp, kp, vp):
        t.requires_grad_(True)

    def padded() -> None:
        attention(q, k, v, causal=True).sum().backward()

    def packed_on(name: str | None) -> Any:
        def run() -> None:
            attention(qp, kp, vp, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx,
                      max_seqlen_k=mx, backend=name).sum().backward()
        return run

    from attnkit.runtime.call import make_call
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import SELECTOR, explain

    pr = probe()
    vc = make_call(qp, kp, vp, causal=True, dropout_p=0.0, window=None, alibi_slopes=None, attn_bias=None,
                   cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx)
    # every backend that can serve the packed call, timed side by side with attnkit's pick and the padded call
    capable = [n for n, why in explain(vc, pr).items() if not why]
    res: dict[str, Any] = {"batch": b, "max_seqlen": s, "heads": h, "head_dim": d, "padding_fraction": pad_frac}
    try:
        res["packed_backend"] = SELECTOR.select(vc, pr).name
        t, errs = interleaved({"padded": padded, "packed": packed_on(None),
                               **{f"packed:{n}": packed_on(n) for n in capable}}, device)
        if "padded" in errs or "packed" in errs:
            raise RuntimeError("; ".join(f"{k}: {v}" for k, v in errs.items()))
        res["padded_ms"] = t["padded"] * 1e3
        res["packed_ms"] = t["packed"] * 1e3
        res["packed_over_padded"] = res["packed_ms"] / res["padded_ms"]
        res["packed_by_backend"] = {n: {"ms": t[f"packed:{n}"] * 1e3, "over_padded": t[f"packed:{n}"] / t["padded"]}
                                    if f"packed:{n}" in t else {"error": errs[f"packed:{n}"]} for n in capable}
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    return res


def warm_gpu(seconds: float = 3.0) -> None:
    """Run matmuls until clocks settle, so the first shapes are not measured on a cold GPU."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    from attnkit.runtime.probe import probe

    p = probe()
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "probe": p.to_dict()}


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["shapes"]
    names = sorted({n for r in rows for n, v in r["results"].items() if r["metric"] in v and n != "attnkit"})
    names.append("attnkit")
    fig, ax = plt.subplots(figsize=(max(10, 1.3 * len(rows)), 5.5))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        vals = [r["results"].get(n, {}).get(r["metric"], 0.0) for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=n,
               edgecolor="black" if n == "attnkit" else None)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["shape"]["label"] + ("" if r["metric"] == "fwdbwd_tflops" else "\n(fwd)") for r in rows],
                       rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (fwd+bwd unless marked fwd)")
    gpu = report["environment"]["probe"]["gpus"]
    ax.set_title(f"attnkit bench: {gpu[0]['name'] if gpu else 'CPU'}, torch "
                 f"{report['environment']['probe']['torch']['version']}, {report['environment']['date'][:10]}")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def run_bench(out: str | None = None, quick: bool = False, png: bool = True) -> int:
    from rich.console import Console
    from rich.table import Table

    from attnkit.errors import AttnkitError
    from attnkit.runtime.probe import probe

    p = probe()
    if p.torch is None:
        raise AttnkitError("bench: torch is not installed; install the torch of your matrix cell first")
    device = "cuda" if p.has_gpu and p.torch.cuda_available else "cpu"
    if device == "cpu" and not quick:
        quick = True
    con = Console(width=180)
    if device == "cuda":
        warm_gpu()
    # host-side overhead first, before the big shapes leave the process with a large heap; 3 repeats (the
    # median one is reported) because the host's state moves a 50 us call by tens of percent
    repeats = sorted((dispatch_overhead(device, n=200 if quick else 2000) for _ in range(3)),
                     key=lambda r: r["overhead_us"])
    dispatch = {**repeats[1], "repeats_us": [round(r["overhead_us"], 3) for r in repeats]}
    shapes = []
    for s in suite(quick):
        con.print(f"bench {s.label} ...")
        shapes.append(bench_shape(s, device))
    report: dict[str, Any] = {"environment": environment(), "device": device, "quick": quick, "shapes": shapes,
                              "dispatch": dispatch, "varlen": varlen_vs_padded(device, quick)}
    ratios = [r["selected_over_oracle"] for r in shapes if "selected_over_oracle" in r]
    sdpa = [r["selected_over_sdpa_default"] for r in shapes if "selected_over_sdpa_default" in r]
    report["summary"] = {
        "min_selected_over_oracle": min(ratios) if ratios else None,
        "min_selected_over_sdpa_default": min(sdpa) if sdpa else None,
        "dispatch_overhead_us": report["dispatch"]["overhead_us"],
        "dispatch_wrapper_only_us": report["dispatch"]["wrapper_only_us"],
        "varlen_packed_over_padded": report["varlen"].get("packed_over_padded"),
    }
    t = Table(title=f"attnkit bench on {device}")
    for col in ("shape", "metric", "selected", "oracle", "sel TFLOP/s", "oracle TFLOP/s", "sdpa default",
                "sel/oracle", "sel/sdpa"):
        t.add_column(col)
    for r in shapes:
        m = r["metric"]
        sel = r["results"]["attnkit"].get(m)
        ora = r["results"].get(r["oracle"], {}).get(m) if r["oracle"] else None
        sd = r["results"]["sdpa_default"].get(m)
        t.add_row(r["shape"]["label"], m.split("_")[0], r["selected"], str(r["oracle"]),
                  f"{sel:.1f}" if sel else "-", f"{ora:.1f}" if ora else "-", f"{sd:.1f}" if sd else "-",
                  f"{r.get('selected_over_oracle', 0):.3f}", f"{r.get('selected_over_sdpa_default', 0):.3f}")
    con.print(t)
    con.print(f"summary: {json.dumps(report['summary'])}")
    if out:
        path = Path(out)
        write_atomic(path, json.dumps(report, indent=1, default=str))
        con.print(f"wrote {path}")
        if png:
            try:
                chart(report, path.with_suffix(".png"))
                con.print(f"wrote {path.with_suffix('.png')}")
            except ImportError:
                con.print("matplotlib not installed: no chart")
    return 0
