"""flex's backward recorded inside attnkit's torch.compile call (graph sizes static), on a GPU: is it right, and do
the compiled graphs run flex's kernels?

Until 2026-12-07 selection refused flex for any compiled call that needs a gradient (one H200 smoke row, compiled
softcap float32 with dynamic=True, failed at trace time in 2026-12-01), so a compiled ALiBi training step ran
cuDNN with a dense bias built in the graph: 0.49-0.53 of eager's speed on the bench's ALiBi training shape (H100,
2026-12-07, docs/results/2026-12-07-h100-bench-compiled-8-shapes-session28.json). Since then only graphs with
dynamic sizes, and packed varlen, are refused (runtime/backends/flex.py, GRAPH_GRAD, GRAPH_GRAD_VARLEN: on this
probe's first run, docs/results/2026-12-07-h100-flex-compiled-grad-session28.json, a packed varlen ALiBi case failed
in inductor's lowering of flex's backward, so varlen is refused and no longer a case here). For each case (ALiBi,
softcap, window, a causal chunk; bf16 / fp16 / fp32), forward + backward of attention(backend="flex"):
1. eager, and compiled with inductor (fullgraph, dynamic=False): output and input gradients against the float64
   reference (runtime/reference.py) within the smoke's tolerances (runtime/smoke.py TOL), and compiled against
   eager; the compiled step's CUDA kernels (profiler), which must include flex's;
2. attention()'s own pick compiled with dynamic=True (the refused case): it must compile with fullgraph and stay
   within the same tolerances, on whatever backend it then records.
Writes JSON to argv[1] (and prints one line a case)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from _probe import DEV, write_report

from attnkit.runtime.attention import attention
from attnkit.runtime.reference import reference_attention
from attnkit.runtime.shape import Shape
from attnkit.runtime.smoke import TOL, _kwargs, inputs

CASES = [
    Shape("ALiBi causal B2 S256 H8 D64", 2, 8, 8, 256, 256, 64, alibi=True),
    Shape("ALiBi causal chunk GQA 8/2 Sq128 Sk512 D128", 2, 8, 2, 128, 512, 128, alibi=True),
    Shape("softcap causal B2 S256 H4 D64", 2, 4, 4, 256, 256, 64, softcap=5.0),
    Shape("window 64 causal B2 S256 H8 D64", 2, 8, 8, 256, 256, 64, window=(64, 0)),
]
DTYPES = {"ALiBi causal B2 S256 H8 D64": ("bfloat16", "float16"), "softcap causal B2 S256 H4 D64": ("float32",
                                                                                                     "bfloat16")}


def _errors(out: Any, grads: tuple[Any, ...], ref: Any, ref_grads: tuple[Any, ...]) -> dict[str, float]:
    errs = {"out": (out.double() - ref).abs().max().item()}
    errs.update({f"d{n}": (g.double() - r).abs().max().item() for n, g, r in zip("qkv", grads, ref_grads, strict=True)})
    return {k: float(f"{v:.3g}") for k, v in errs.items()}


def _kernels(step: Any) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def one(s: Shape, dtype: str) -> dict[str, Any]:
    t = inputs(s, dtype, DEV)  # the smoke's tensors: drawn on the host, requiring grad
    kw = _kwargs(t)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (t.q, t.k, t.v))
    ref = reference_attention(q64, k64, v64, **_kwargs(t, reference=True))
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    go = g.to(t.q.dtype)
    row: dict[str, Any] = {"case": s.label, "dtype": dtype, "tol": dict(zip(("out", "grad"), TOL[dtype], strict=True))}

    def run(fn: Any) -> tuple[Any, tuple[Any, ...]]:
        out = fn(t.q, t.k, t.v)
        return out, torch.autograd.grad(out, (t.q, t.k, t.v), go)

    def forced(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, backend="flex", **kw)

    def own(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, **kw)

    problems = []
    eager = run(forced)
    row["eager_err"] = _errors(*eager, ref, ref_grads)
    for name, fn, dynamic in (("compiled_static_flex", forced, False), ("compiled_dynamic_own_pick", own, True)):
        torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            c = torch.compile(fn, fullgraph=True, dynamic=dynamic)
            got = run(c)
        except Exception as e:  # a compile that fails is this case's finding, not the probe's end
            row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            problems.append(f"{name}: raised")
            continue
        entry: dict[str, Any] = {"compile_s": round(time.perf_counter() - t0, 1), "err": _errors(*got, ref, ref_grads)}
        entry["vs_eager_flex"] = _errors(got[0], got[1], eager[0].double(), tuple(x.double() for x in eager[1]))
        entry["kernels"] = _kernels(lambda c=c: run(c))
        entry["flex_kernels"] = sum("flex" in k for k in entry["kernels"])
        row[name] = entry
        if entry["err"]["out"] > TOL[dtype][0] or max(v for k, v in entry["err"].items() if k != "out") > TOL[dtype][1]:
            problems.append(f"{name}: error above tolerance")
        if name == "compiled_static_flex" and not entry["flex_kernels"]:
            problems.append(f"{name}: no flex kernel ran")
    row["ok"] = not problems
    row["problems"] = problems
    return row


def main() -> None:
    rows = []
    for s in CASES:
        for dtype in DTYPES.get(s.label, ("bfloat16",)):
            r = one(s, dtype)
            rows.append(r)
            print(("ok" if r["ok"] else "failed"), s.label, dtype, r["eager_err"],
                  {k: r[k].get("err", r[k].get("error")) for k in ("compiled_static_flex", "compiled_dynamic_own_pick")},
                  r["problems"], flush=True)
            write_report(__doc__, "max abs error", rows)
    print(f"summary: {sum(r['ok'] for r in rows)} ok, {sum(not r['ok'] for r in rows)} failed of {len(rows)}")


if __name__ == "__main__":
    sys.exit(main())
