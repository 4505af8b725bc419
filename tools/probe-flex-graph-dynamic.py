"""flex's forward inside attnkit's torch.compile call with sizes the graph keeps dynamic, on a GPU or the CPU: does it
compile, and is it right at a second size?

Until 2026-12-07 selection refused flex in a graph only for a backward with dynamic sizes (runtime/backends/flex.py
GRAPH_GRAD), and since then (rule 5, select.graph_alibi_order) every half-precision ALiBi call in a graph goes to flex
first. On the CPU (torch 2.13) flex's forward inside attnkit's graph call failed in inductor under
torch.compile(dynamic=True) ("A subgraph argument other than striding has been modified; FakeTensorUpdater cannot
update this argument"), with every size marked static too, and passed with dynamic=None at two sizes (the second
compile keeps the changed sizes dynamic); so flex is now refused under dynamic=True (GRAPH_DYNAMIC). For each case
(ALiBi, softcap, a window; bf16), forward only: attention(backend="flex") compiled with dynamic=True (that refusal
lifted here, to see what it guards), and with dynamic=None at two sizes, and attention()'s own pick with dynamic=True,
each called at two sizes and compared with eager flex at both; and, at the first size, attention(backend="flex") under
dynamic=True with every size of q, k, v and the slopes marked static, and torch's own flex_attention (no attnkit)
with a causal block mask compiled with dynamic=True (is the failure attnkit's graph call, or flex's?).
Writes JSON to argv[1] (and prints one line a case)."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any
from unittest import mock

import torch
from _probe import DEV, write_report

from attnkit.runtime.attention import attention
from attnkit.runtime.backends import flex as flex_backend
from attnkit.runtime.shape import Shape, make_inputs

CASES = [
    Shape("ALiBi causal chunk GQA 8/2 Sq128 Sk512 D128", 2, 8, 2, 128, 512, 128, alibi=True, train=False),
    Shape("ALiBi causal B2 S256 H8 D64", 2, 8, 8, 256, 256, 64, alibi=True, train=False),
    Shape("softcap causal B2 S256 H4 D64", 2, 4, 4, 256, 256, 64, softcap=5.0, train=False),
    Shape("window 64 causal B2 S256 H8 D64", 2, 8, 8, 256, 256, 64, window=(64, 0), train=False),
]


def _lifted(self: Any, call: Any, capability: Any) -> list[str]:
    """flex's reasons without GRAPH_DYNAMIC: the refusal this probe looks behind."""
    return [r for r in _REASONS(self, call, capability) if r != flex_backend.GRAPH_DYNAMIC]


_REASONS = flex_backend.Flex.extra_reasons


def grown(s: Shape) -> Shape:
    return replace(s, batch=s.batch + 1, seqlen_q=s.seqlen_q + 64, seqlen_k=s.seqlen_k + 64)


def one(s: Shape) -> dict[str, Any]:
    sizes = [make_inputs(x, DEV, seed=i) for i, x in enumerate((s, grown(s)))]

    def fn(backend: str | None) -> Any:
        def f(q: Any, k: Any, v: Any, kw: dict[str, Any]) -> Any:
            return attention(q, k, v, backend=backend, **kw)
        return f

    def kw_of(t: Any) -> dict[str, Any]:
        return {k: v for k, v in t.kw.items() if v is not None and not (k == "softcap" and not v)}

    ref = [fn("flex")(t.q, t.k, t.v, kw_of(t)) for t in sizes]
    row: dict[str, Any] = {"case": s.label}
    for name, backend, dynamic in (("flex_dynamic", "flex", True), ("flex_default_two_sizes", "flex", None),
                                   ("own_pick_dynamic", None, True)):
        torch._dynamo.reset()
        c = torch.compile(fn(backend), fullgraph=True, dynamic=dynamic)
        got: dict[str, Any] = {}
        with mock.patch.object(flex_backend.Flex, "extra_reasons", _lifted if backend == "flex" else _REASONS):
            for i, t in enumerate(sizes):
                try:
                    out = c(t.q, t.k, t.v, kw_of(t))
                    got[f"size{i}"] = float(f"{(out.float() - ref[i].float()).abs().max().item():.3g}")
                except Exception as e:  # this variant's finding, not the probe's end
                    got[f"size{i}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
        row[name] = got
    t = sizes[0]
    kw = kw_of(t)
    for x in (t.q, t.k, t.v, *([kw["alibi_slopes"]] if "alibi_slopes" in kw else [])):
        for d in range(x.dim()):
            torch._dynamo.mark_static(x, d)
    with mock.patch.object(flex_backend.Flex, "extra_reasons", _lifted):
        row["flex_dynamic_sizes_marked_static"] = _attempt(
            lambda: torch.compile(fn("flex"), fullgraph=True, dynamic=True)(t.q, t.k, t.v, kw), ref[0])
    row["torch_flex_dynamic"] = _torch_flex(s)
    row["ok"] = all(isinstance(v, float) and v < 0.05 for k, g in row.items() if isinstance(g, dict)
                    for v in g.values())
    return row


def _attempt(run: Any, ref: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    try:
        return {"size0": float(f"{(run().float() - ref.float()).abs().max().item():.3g}")}
    except Exception as e:
        return {"size0": f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"}


def _torch_flex(s: Shape) -> dict[str, Any]:
    """torch's flex_attention with a causal block mask, (B, H, S, D), compiled with dynamic=True: no attnkit (bf16 on
    a GPU; float32 on the CPU, where inductor's flex kernel failed to build in bf16, C++ compile error)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dt = torch.bfloat16 if DEV == "cuda" else torch.float32  # inductor's CPU flex kernel did not build in bf16
    q = torch.randn(s.batch, s.heads, s.seqlen_q, s.head_dim, device=DEV, dtype=dt)
    k = torch.randn(s.batch, s.heads, s.seqlen_k, s.head_dim, device=DEV, dtype=dt)

    def causal(b: Any, h: Any, i: Any, j: Any) -> Any:
        return i + (s.seqlen_k - s.seqlen_q) >= j

    def f(q: Any, k: Any, v: Any) -> Any:
        bm = create_block_mask(causal, None, None, q.shape[-2], k.shape[-2], device=DEV)
        return flex_attention(q, k, v, block_mask=bm)

    return _attempt(lambda: torch.compile(f, fullgraph=True, dynamic=True)(q, k, k), f(q, k, k))


def main() -> None:
    rows = []
    for s in CASES:
        r = one(s)
        rows.append(r)
        print("ok" if r["ok"] else "failed", s.label, {k: v for k, v in r.items() if isinstance(v, dict)}, flush=True)
        write_report(__doc__, "max abs difference from eager flex", rows)
    print(f"summary: {sum(r['ok'] for r in rows)} ok, {sum(not r['ok'] for r in rows)} failed of {len(rows)}")


if __name__ == "__main__":
    sys.exit(main())
