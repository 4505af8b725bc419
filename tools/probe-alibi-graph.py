"""ALiBi in a torch.compile graph, on a GPU: what does a backend that takes ALiBi as a dense bias pay there, against
flex, which takes the slopes?

Eager attention() builds the dense ALiBi bias once per slopes tensor and keeps it (runtime/layout.py BiasCache), and
the sweep times the dense-bias backends that way. A graph cannot keep it: the bias is built inside the graph on every
call. On the bench's GQA ALiBi chunk (Sq2048 Sk16384, D128) the compiled forward ran 0.68 of eager, 919 us of bias
per call (H100, 2026-12-07, docs/results/2026-12-07-h100-bench-compiled-alibi-3-shapes-flex-backward-session28.json).
For each shape (ALiBi LM calls: training, prefill, chunked prefill, few queries, decode; D64 and D128; tiny to
large), each candidate eager and compiled (fullgraph, static sizes), raced side by side with a sync per call and back
to back: `sdpa` (a dense bias), `flex` (a score_mod), and attention()'s own pick. Per shape it reports every time,
each dense-bias backend's graph / eager time, and which candidate wins eagerly and in the graph.
Writes JSON to argv[1] (and prints one line a shape)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from _probe import DEV, write_report

from attnkit.bench.timer import b2b_calls, interleaved, sync_iters, warm
from attnkit.runtime.attention import attention
from attnkit.runtime.shape import Shape, make_inputs

SHAPES = [
    Shape("MHA D128 S2048 B4 H16 causal (train)", 4, 16, 16, 2048, 2048, 128, train=True, alibi=True),
    Shape("GQA 32/8 D128 chunk Sq2048 Sk16384 B1", 1, 32, 8, 2048, 16384, 128, train=False, alibi=True),
    Shape("MHA D64 S1024 B8 H16 causal fp16", 8, 16, 16, 1024, 1024, 64, "float16", train=False, alibi=True),
    Shape("MHA D128 chunk Sq512 Sk4096 B2 H32", 2, 32, 32, 512, 4096, 128, train=False, alibi=True),
    Shape("MHA D128 few Sq4 Sk8192 B8 H32", 8, 32, 32, 4, 8192, 128, train=False, alibi=True),
    Shape("MHA D128 decode Sk4096 B16 H32", 16, 32, 32, 1, 4096, 128, train=False, alibi=True),
    Shape("MHA D64 small S256 B2 H12 causal", 2, 12, 12, 256, 256, 64, train=False, alibi=True),
]
FORCED = ("sdpa", "flex")  # sdpa: the dense bias (the table's ALiBi picks but flex: sdpa, sdpa_cudnn); flex: slopes
DENSE = ("sdpa",)


def one(s: Shape, grad: bool) -> dict[str, Any]:
    t = make_inputs(s, DEV, requires_grad=grad)
    kw = {k: v for k, v in t.kw.items() if v is not None}
    kw["alibi_slopes"] = t.kw["alibi_slopes"]
    go = torch.randn_like(t.q) if grad else None

    def fn_for(name: str) -> Any:
        def f(q: Any, k: Any, v: Any) -> Any:
            return attention(q, k, v, **kw) if name == "own" else attention(q, k, v, backend=name, **kw)
        return f

    torch._dynamo.reset()
    fns: dict[str, Any] = {}
    for name in (*FORCED, "own"):
        f = fn_for(name)
        fns[f"{name} eager"] = f
        fns[f"{name} graph"] = torch.compile(f, fullgraph=True, dynamic=False)

    def call(f: Any) -> Any:
        out = f(t.q, t.k, t.v)
        if grad:
            torch.autograd.grad(out, (t.q, t.k, t.v), go)
        return out

    runs = {n: (lambda f=f: call(f)) for n, f in fns.items()}
    row: dict[str, Any] = {"shape": s.label, "pass": "fwdbwd" if grad else "fwd", "dtype": s.dtype,
                           "head_dim": s.head_dim, "bias_elements": s.batch * s.heads * s.seqlen_q * s.seqlen_k}
    with torch.set_grad_enabled(grad):
        t0 = time.perf_counter()
        outs, errors = warm(runs, DEV, times=2)
        row["warm_s"] = round(time.perf_counter() - t0, 1)
        if errors:
            row["errors"] = errors
        runs = {n: r for n, r in runs.items() if n not in errors}
        ref = outs.get("sdpa eager")
        if ref is not None:
            row["max_abs_diff_vs_sdpa_eager"] = {n: float((o.detach().float() - ref.detach().float()).abs().max())
                                                 for n, o in outs.items()}
        if not runs:
            return row
        fastest = min(interleaved(runs, DEV, iters=2).values())
        sync = interleaved(runs, DEV, iters=sync_iters(fastest, 12), seed=1)
        b2b = interleaved(runs, DEV, iters=6, calls=b2b_calls(fastest), seed=2)
    row["ms"] = {n: {"sync": round(sync[n] * 1e3, 4), "b2b": round(b2b[n] * 1e3, 4)} for n in runs}
    for mode, times in (("sync", sync), ("b2b", b2b)):
        row.setdefault("graph_over_eager", {})[mode] = {
            b: round(times[f"{b} graph"] / times[f"{b} eager"], 3) for b in (*FORCED, "own")
            if f"{b} graph" in times and f"{b} eager" in times}
        for where in ("eager", "graph"):
            cands = {b: times[f"{b} {where}"] for b in FORCED if f"{b} {where}" in times}
            if cands:
                best = min(cands, key=lambda b: cands[b])
                row.setdefault("winner", {}).setdefault(where, {})[mode] = best
                if f"own {where}" in times:
                    row.setdefault("own_over_best", {}).setdefault(where, {})[mode] = round(
                        cands[best] / times[f"own {where}"], 3)
    return row


def main() -> None:
    rows = []
    for s in SHAPES:
        for grad in ((False, True) if s.train else (False,)):
            try:
                r = one(s, grad)
            except Exception as e:  # one shape's failure is its row, not the probe's end
                r = {"shape": s.label, "pass": "fwdbwd" if grad else "fwd", "error": f"{type(e).__name__}: {e}"[:400]}
            rows.append(r)
            print(s.label, r["pass"], r.get("graph_over_eager"), r.get("winner"), r.get("own_over_best"),
                  r.get("errors") or r.get("error") or "", flush=True)
            write_report(__doc__, "ms", rows)
    print(f"summary: {len(rows)} rows, {sum('ms' in r for r in rows)} timed")


if __name__ == "__main__":
    sys.exit(main())
