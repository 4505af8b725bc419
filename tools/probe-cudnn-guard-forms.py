"""Where the cuDNN gradient-layout guard's host time goes in a synced training step, and which form of it costs least.

The guard (_sdpa.grad_like_output, docs/cudnn-grad-layout.md) added 23-32 us per fwd+bwd step with a sync on the
H100 (2026-12-06), +0 back to back, as a tensor hook and as two views alike. This probe times forms of it side by
side on the plain SDPA call (no attnkit dispatch in any candidate), and profiles each form's step: when each kernel
is launched on the host and when it runs on the GPU, so the GPU's idle time is placed (before the backward kernel:
host time between the forward's launch and the backward's launch, which a sync per step exposes).

Forms, on o = F.scaled_dot_product_attention(q.transpose(1, 2), ...) (a (B, H, S, D) view of a (B, S, H, D) buffer):
- plain: no guard (the user's call);
- hook: o.register_hook(relayout) (attnkit's form);
- hook_noop: o.register_hook(lambda g: g): the hook machinery alone;
- prehook: o.grad_fn.register_prehook(relayout of grad_outputs[0]): a node pre-hook, no Tensor.register_hook wrapper;
- builtin: the user-facing y = o.transpose(1, 2) gets y.register_hook(torch.Tensor.contiguous): no Python frame in
  the backward (dO arrives like o whenever the user's dY is (B, S, H, D)-contiguous, which contiguous() makes it);
- views: the user-facing y seen flat and back, y.view(-1).view(y.shape): autograd's own view nodes, whose backward
  reshape copies a dY that is not (B, S, H, D)-contiguous; no Python in the backward (tried in attnkit at 40d8073);
- attnkit: attnkit.attention(q, k, v, causal=True, backend="sdpa_cudnn") as it is; attnkit_bound: attnkit.bind(...)
  once, then the bound call; direct_hook: torch._scaled_dot_product_cudnn_attention called directly with the hook
  (attnkit's runner for this call, without attention() around it).

    python tools/probe-cudnn-guard-forms.py [OUT.json]
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F
from _probe import DEV, profiled_steps, write_report

import attnkit
from attnkit.bench.timer import interleaved, warm, warm_gpu

SHAPES = [  # (label, batch, heads, seqlen, head_dim, dtype): the validate's GPT-2 row and a short call
    ("GPT-2-medium fp16 H16 D64 S1000", 8, 16, 1000, 64, torch.float16),
    ("small H16 D64 S512", 4, 16, 512, 64, torch.bfloat16),
]
PROFILED_STEPS = 25
ROUNDS, SYNC_ITERS, B2B_ITERS = (5, 200, 20) if DEV == "cuda" else (2, 20, 2)


def _relayout_tensor(stride: tuple[int, ...]) -> Any:
    def relayout(grad: Any) -> Any:
        return grad if grad.stride() == stride else grad.new_empty_strided(grad.shape, stride).copy_(grad)
    return relayout


def _relayout_node(stride: tuple[int, ...]) -> Any:
    def relayout(grads: Any) -> Any:
        g = grads[0]
        if g is None or g.stride() == stride:
            return None
        return (g.new_empty_strided(g.shape, stride).copy_(g), *grads[1:])
    return relayout


def forms(q: Any, k: Any, v: Any) -> dict[str, Any]:
    def sdpa(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    def plain(q: Any, k: Any, v: Any) -> Any:
        return sdpa(q, k, v).transpose(1, 2)

    def hook(q: Any, k: Any, v: Any) -> Any:
        o = sdpa(q, k, v)
        o.register_hook(_relayout_tensor(o.stride()))
        return o.transpose(1, 2)

    def hook_noop(q: Any, k: Any, v: Any) -> Any:
        o = sdpa(q, k, v)
        o.register_hook(lambda g: g)
        return o.transpose(1, 2)

    def prehook(q: Any, k: Any, v: Any) -> Any:
        o = sdpa(q, k, v)
        o.grad_fn.register_prehook(_relayout_node(o.stride()))
        return o.transpose(1, 2)

    def builtin(q: Any, k: Any, v: Any) -> Any:
        y = sdpa(q, k, v).transpose(1, 2)
        y.register_hook(torch.Tensor.contiguous)
        return y

    def views(q: Any, k: Any, v: Any) -> Any:
        y = sdpa(q, k, v).transpose(1, 2)
        return y.view(-1).view(y.shape)

    def direct_hook(q: Any, k: Any, v: Any) -> Any:  # attnkit's runner for this call, without attention() around it
        o = torch._scaled_dot_product_cudnn_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                                      True, 0.0, True, False, scale=None)[0]
        o.register_hook(_relayout_tensor(o.stride()))
        return o.transpose(1, 2)

    bound = attnkit.bind(q, k, v, causal=True, backend="sdpa_cudnn" if DEV == "cuda" else "sdpa")

    def ak(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attention(q, k, v, causal=True, backend="sdpa_cudnn" if DEV == "cuda" else "sdpa")

    return {"plain": plain, "hook": hook, "hook_noop": hook_noop, "prehook": prehook, "builtin": builtin,
            "views": views, "attnkit": ak, "attnkit_bound": bound,
            **({"direct_hook": direct_hook} if DEV == "cuda" else {})}


def timeline(fn: Any, steps: int) -> dict[str, Any]:
    """One profiled run of `steps` synced steps: per kernel (in GPU order), the median host launch time and GPU
    start / end, us from the step's start on the host; the step's host wall time and the GPU's idle time in it."""
    marks, events = profiled_steps(fn, steps)
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
                and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_step: list[dict[str, Any]] = []
    for s in marks:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        ks = [kk for kk in kernels if (lk := launches.get(kk["args"].get("correlation"))) and t0 <= lk["ts"] <= t1]
        rows = [{"kernel": kk["name"][:60], "launch": launches[kk["args"]["correlation"]]["ts"] - t0,
                 "start": kk["ts"] - t0, "end": kk["ts"] + kk["dur"] - t0} for kk in ks]
        busy = sum(kk["dur"] for kk in ks)
        per_step.append({"wall": s["dur"], "gpu_busy": busy, "rows": rows})
    if not per_step:
        return {"error": "no profiled steps"}
    n = min(len(p["rows"]) for p in per_step)
    med = statistics.median
    rows = [{"kernel": per_step[0]["rows"][i]["kernel"],
             **{key: round(med(p["rows"][i][key] for p in per_step), 1) for key in ("launch", "start", "end")}}
            for i in range(n)]
    for i, r in enumerate(rows):  # the GPU's wait before each kernel: for the host (launch after the last end)
        r["gpu_idle_before"] = round(r["start"] - (rows[i - 1]["end"] if i else 0.0), 1)
    return {"wall_us": round(med(p["wall"] for p in per_step), 1),
            "gpu_busy_us": round(med(p["gpu_busy"] for p in per_step), 1),
            "kernels_per_step": sorted({len(p["rows"]) for p in per_step}), "kernels": rows}


def main() -> None:
    if DEV == "cuda":
        warm_gpu()
    rows = []
    for label, b, h, s, d, dtype in SHAPES if DEV == "cuda" else [("tiny", 1, 4, 16, 8, torch.float32)]:
        q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        fns = {n: (lambda f=f, q=q, k=k, v=v, g=g: f(q, k, v).backward(g)) for n, f in forms(q, k, v).items()}
        _, errors = warm(fns, DEV, times=3)
        fns = {n: f for n, f in fns.items() if n not in errors}
        ref = {}
        for n, f in fns.items():  # every form's gradients against the plain call's (dO laid out like o here)
            for t in (q, k, v):
                t.grad = None
            f()
            ref[n] = [t.grad.detach().clone() for t in (q, k, v)]
        err = {n: max(float((a.float() - b_.float()).abs().max()) for a, b_ in zip(r, ref["plain"], strict=True))
               for n, r in ref.items()}
        # ROUNDS interleaved runs, each with its own order: how far a form's difference moves from run to run
        rounds = [(interleaved(fns, DEV, iters=SYNC_ITERS, seed=2 * r + 1),
                   interleaved(fns, DEV, iters=B2B_ITERS, calls=20, seed=2 * r + 2)) for r in range(ROUNDS)]
        sync = {n: statistics.median(r[0][n] for r in rounds) for n in fns}
        b2b = {n: statistics.median(r[1][n] for r in rounds) for n in fns}
        prof = {n: timeline(f, PROFILED_STEPS) for n, f in fns.items()}
        base = sync["plain"], b2b["plain"]
        row = {"shape": label, "errors": errors, "max_grad_diff_vs_plain": err,
               "us": {n: {"sync": round(sync[n] * 1e6, 1), "b2b": round(b2b[n] * 1e6, 1),
                          "sync_over_plain": round((sync[n] - base[0]) * 1e6, 1),
                          "b2b_over_plain": round((b2b[n] - base[1]) * 1e6, 1),
                          "sync_over_plain_per_round": [round((r[0][n] - r[0]["plain"]) * 1e6, 1) for r in rounds],
                          "b2b_over_plain_per_round": [round((r[1][n] - r[1]["plain"]) * 1e6, 1) for r in rounds]}
                      for n in fns},
               "profile": prof}
        rows.append(row)
        print(f"{label}: " + "; ".join(f"{n} {t['sync_over_plain_per_round']}/{t['b2b_over_plain_per_round']}"
                                       for n, t in row["us"].items()), flush=True)
        for n, p in prof.items():
            ks = p.get("kernels", [])
            print(f"  {n}: wall {p.get('wall_us')} busy {p.get('gpu_busy_us')} | " + " | ".join(
                f"{r['kernel'][:28]} L{r['launch']:.0f} S{r['start']:.0f} E{r['end']:.0f} idle{r['gpu_idle_before']:.0f}"
                for r in ks), flush=True)
    write_report(__doc__, "us per step, median of the rounds' medians; sync: a device sync after every step; b2b: 20 "
                 "steps then one sync; profile: us from the step's start on the host, median over profiled steps", rows)


if __name__ == "__main__":
    main()
