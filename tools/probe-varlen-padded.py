"""Where a packed-varlen call's time goes on attnkit's routes, against the plain padded call a user writes.

The 2026-12-04 validate on the H200 (packed short x400 of 4-48 tokens, H8 D32, bf16, not causal) timed fwd+bwd:
the plain padded SDPA call (mask built once) 662 us with a sync, 491 back to back; attention() on torch_varlen 912
/ 838, forced to sdpa (the padded route: unpack, mask, SDPA, repack) 1164 / 1144, to sdpa_efficient 1125 / 998.
The padded route's kernels are the plain call's plus ~13 small copies, which does not explain 500 us. The shapes are
the validate's packed ones (tune.validation_shapes, the same lengths). Candidates, interleaved in one run
(bench/timer.py), per shape:
- plain: F.scaled_dot_product_attention on the padded batch, its key-padding mask built once (the user's data is
  padded already)
- by-hand: from the packed tensors, the padded route written out with no attnkit call (layout.unpack with indices
  computed once, the same mask, SDPA, index_select back); attention's sdpa route adds its dispatch and, where
  cuDNN's backward may run, the output-gradient relayout hook (_sdpa.grad_like_output)
- attention B: attnkit.attention(packed q, k, v, cu_seqlens..., backend=B) for each backend that serves the call,
  and attention() choosing (its pick per pass is recorded)
- fa2-direct: torch's varlen FlashAttention kernels (aten._flash_attention_forward/backward, what
  torch.nn.attention.varlen calls) under a plain autograd.Function, with no torch.library custom op between: is
  torch_varlen's extra time in its kernels or in the custom ops' host path (2026-12-05, H100: torch_varlen's
  fwd+bwd 1.48x the plain call's with 7 GPU ops against 9)?
Each timed forward and forward+backward, with a sync after each step and back to back, and each step's GPU ops
and their summed GPU time (kernels, copies and sets: torch.profiler), so a route's extra time is split into GPU time
and host time. Every
candidate's output is checked against the plain call's once. The report is written after each row.

    python tools/probe-varlen-padded.py [OUT.json]
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnkit
from attnkit.bench.shapes import mixed_lengths
from attnkit.bench.timer import interleaved, warm
from attnkit.bench.tune import validation_shapes
from attnkit.runtime import layout
from attnkit.runtime.shape import Shape, varlen

BACKENDS = ("sdpa", "sdpa_efficient", "sdpa_cudnn_varlen", "torch_varlen", "cudnn_ragged", "flash_attn4")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of the probe itself


def shapes() -> list[Shape]:
    if DEV == "cuda":
        return [s for s in validation_shapes(False) if s.lengths is not None]
    return [varlen("tiny x12 2-9 H2 D8", mixed_lengths(12, 2, 9, 1), heads=2, kv_heads=2, head_dim=8, causal=False,
                   dtype="float32")]


def candidates(s: Shape) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    assert s.lengths is not None and not s.causal and s.window is None and s.heads == s.kv_heads
    lengths, n, h, d, dtype = list(s.lengths), len(s.lengths), s.heads, s.head_dim, getattr(torch, s.dtype)
    m, total = max(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    q, k, v = (torch.randn(total, h, d, device=DEV, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(total, h, d, device=DEV, dtype=dtype)
    idx = layout.varlen_indices(cu, m)
    lens = torch.tensor(lengths, device=DEV)
    mask = layout.safe_rows(layout.allowed_mask(m, m, causal=False, window=None, device=DEV, lengths_q=lens,
                                                lengths_k=lens))[0]
    padded = [layout.unpack(t, idx, n, m).detach().requires_grad_() for t in (q, k, v)]
    padded_g = layout.unpack(g, idx, n, m)

    def sdpa(pq: Any, pk: Any, pv: Any) -> Any:
        return F.scaled_dot_product_attention(pq.transpose(1, 2), pk.transpose(1, 2), pv.transpose(1, 2),
                                              attn_mask=mask).transpose(1, 2)

    def by_hand() -> Any:
        pq, pk, pv = (layout.unpack(t, idx, n, m) for t in (q, k, v))
        return sdpa(pq, pk, pv).reshape(n * m, h, d).index_select(0, idx)

    cus = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": m, "max_seqlen_k": m}
    fns: dict[str, tuple[Any, Any]] = {"plain": (lambda: sdpa(*padded), padded_g), "by-hand": (by_hand, g)}
    if DEV == "cuda":
        fns["fa2-direct"] = (lambda: _Fa2Varlen.apply(q, k, v, cu, m), g)
    absent: dict[str, str] = {}
    for be in (*BACKENDS, None):
        name = f"attention {be or 'auto'}"
        try:
            attnkit.attention(q, k, v, backend=be, **cus)
        except Exception as exc:  # a backend that does not serve the call here: said (every reason), not timed
            absent[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
            continue
        fns[name] = (lambda be=be: attnkit.attention(q, k, v, backend=be, **cus), g)
    runs: dict[str, Any] = {}
    for name, (fn, grad) in fns.items():
        runs[f"fwd {name}"] = fn
        runs[f"fwdbwd {name}"] = lambda fn=fn, grad=grad: fn().backward(grad)
    extra = {"tokens": total, "sequences": n, "longest": m, "leaves": (q, k, v, *padded), "idx": idx, "n": n,
             "m": m, "picks": {}}
    for ps, grad in (("fwd", False), ("fwdbwd", True)):
        with torch.set_grad_enabled(grad):
            try:
                extra["picks"][ps] = attnkit.bind(q, k, v, **cus).backend.name
            except Exception as exc:
                extra["picks"][ps] = f"? {type(exc).__name__}"
    return runs, absent, extra


class _Fa2Varlen(torch.autograd.Function):
    """aten's varlen FlashAttention-2 pair with no custom op around it (not causal, no dropout)."""

    @staticmethod
    def forward(ctx: Any, q: Any, k: Any, v: Any, cu: Any, m: int) -> Any:
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, False, False)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.m = m
        return out

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(g.contiguous(), q, k, v, out, lse, cu, cu, ctx.m, ctx.m,
                                                              0.0, False, rng, unused)
        return dq, dk, dv, None, None


def packed_out(name: str, out: Any, extra: dict[str, Any]) -> Any:
    """A candidate's forward output as packed rows (plain's is the padded batch)."""
    if name == "plain":
        return out.reshape(extra["n"] * extra["m"], *out.shape[2:]).index_select(0, extra["idx"])
    return out


def mismatches(outs: dict[str, Any], extra: dict[str, Any]) -> dict[str, float]:
    """Each candidate's largest difference from the plain call's output, where it is over 2e-2."""
    if "plain" not in outs:
        return {}
    ref = packed_out("plain", outs["plain"], extra).float()
    bad = {}
    for name, out in outs.items():
        diff = float((packed_out(name, out, extra).float() - ref).abs().max())
        if diff > 2e-2:
            bad[name] = round(diff, 4)
    return bad


def gpu_ops(fn: Any, leaves: tuple[Any, ...]) -> tuple[int, float, dict[str, float]] | tuple[None, None, None]:
    """One profiled step: its GPU ops (kernels, copies, sets), their summed time in us, and the host ops that took
    the most host time of their own (us); Nones on the CPU. No gradient is there to accumulate into."""
    if DEV != "cuda":
        return None, None, None
    from torch.profiler import ProfilerActivity, profile

    for t in leaves:
        t.grad = None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:8]
    return (len(ops), round(sum(e.time_range.elapsed_us() for e in ops), 1),
            {a.key[:80]: round(a.self_cpu_time_total, 1) for a in host})


def main() -> None:
    rows: list[dict[str, Any]] = []
    report = {"what": __doc__.split("\n\n")[0], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "unit": "us per step, median; sync: a device sync after every step; b2b: 20 steps then one sync; "
                      "gpu_ops: kernels, copies and sets of one step; gpu_us: their summed time; host_top_us: the host ops with the "
                      "most host time of their own (one profiled step, profiler on)",
              "rows": rows}
    for s in shapes():
        runs, absent, extra = candidates(s)
        for ps in ("fwd", "fwdbwd"):
            sel = {n[len(ps) + 1:]: f for n, f in runs.items() if n.split(" ", 1)[0] == ps}
            with torch.set_grad_enabled(ps == "fwdbwd"):
                _, errors = warm(sel, DEV, times=3)
                sel = {n: f for n, f in sel.items() if n not in errors}
                if ps == "fwd":
                    with torch.no_grad():
                        outs = {n: f() for n, f in sel.items()}
                    wrong = mismatches(outs, extra)
                sync = interleaved(sel, DEV, iters=40, seed=1)
                b2b = interleaved(sel, DEV, iters=6, calls=20, seed=2)
                ops = {n: gpu_ops(f, extra["leaves"]) for n, f in sel.items()}
            row = {"shape": s.label, "pass": ps, "tokens": extra["tokens"], "sequences": extra["sequences"],
                   "longest": extra["longest"], "auto_pick": extra["picks"].get(ps), "absent": absent,
                   "errors": errors, "outputs_off_plain": wrong,
                   "us": {n: {"sync": round(sync[n] * 1e6, 1), "b2b": round(b2b[n] * 1e6, 1), "gpu_ops": ops[n][0],
                              "gpu_us": ops[n][1], "host_top_us": ops[n][2]}
                          for n in sel}}
            rows.append(row)
            base = row["us"].get("plain")
            print(f"{s.label} {ps}: " + "; ".join(
                f"{n} {t['sync']:.0f}/{t['b2b']:.0f} us"
                + (f" ({t['sync'] / base['sync']:.2f}x/{t['b2b'] / base['b2b']:.2f}x)" if base else "")
                + ("" if t["gpu_ops"] is None else f", {t['gpu_ops']} GPU ops in {t['gpu_us']:.0f} us")
                for n, t in row["us"].items()), flush=True)
            if len(sys.argv) > 1:  # after each row: a run cut by its timeout keeps what it measured
                tmp = Path(sys.argv[1] + ".tmp")
                tmp.write_text(json.dumps(report, indent=1), encoding="utf-8")
                tmp.replace(sys.argv[1])


if __name__ == "__main__":
    main()
