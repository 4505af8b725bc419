"""Where a packed-varlen call's time goes on attnkit's routes, against the plain padded call a user writes.

The 2026-12-04 validate on the H200 (packed short x400 of 4-48 tokens, H8 D32, bf16, not causal) timed fwd+bwd:
the plain padded SDPA call (mask built once) 662 us with a sync, 491 back to back; attention() on torch_varlen 912
/ 838, forced to sdpa (the padded route: unpack, mask, SDPA, repack) 1164 / 1144, to sdpa_efficient 1125 / 998.
The padded route's kernels are the plain call's plus ~13 small copies, which does not explain 500 us. Candidates,
interleaved in one run (bench/timer.py), per shape:
- plain: F.scaled_dot_product_attention on the padded batch, its key-padding mask built once (the user's data is
  padded already)
- by-hand: from the packed tensors, the padded route written out with no attnkit call (layout.unpack with indices
  computed once, the same mask, SDPA, index_select back): what the route costs without attnkit's dispatch
- attention B: attnkit.attention(packed q, k, v, cu_seqlens..., backend=B) for each backend that serves the call,
  and attention() choosing
Each timed forward and forward+backward, with a sync after each step and back to back, and each step's CUDA kernel
count (torch.profiler), so a route's extra time is split into launches and the rest.

    python tools/probe-varlen-padded.py [OUT.json]
"""

from __future__ import annotations

import datetime as dt
import json
import random
import sys
from typing import Any

import torch
import torch.nn.functional as F

import attnkit
from attnkit.bench.timer import interleaved, warm
from attnkit.runtime import layout

SHAPES = [  # (label, sequences, shortest, longest, heads, head_dim): the validate's packed shapes, not causal
    ("packed short x400 4-48 H8 D32", 400, 4, 48, 8, 32),
    ("packed encoder x64 24-200 H12 D64", 64, 24, 200, 12, 64),
]
BACKENDS = ("sdpa", "sdpa_efficient", "sdpa_cudnn_varlen", "torch_varlen", "cudnn_ragged", "flash_attn4")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of the probe itself
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


def candidates(n: int, lo: int, hi: int, h: int, d: int) -> tuple[dict[str, Any], dict[str, str]]:
    rng = random.Random(n * 1000 + hi)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    m, total = max(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    q, k, v = (torch.randn(total, h, d, device=DEV, dtype=DTYPE, requires_grad=True) for _ in range(3))
    g = torch.randn(total, h, d, device=DEV, dtype=DTYPE)
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

    varlen = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": m, "max_seqlen_k": m}
    fns: dict[str, tuple[Any, Any]] = {"plain": (lambda: sdpa(*padded), padded_g), "by-hand": (by_hand, g)}
    absent: dict[str, str] = {}
    for be in (*BACKENDS, None):
        name = f"attention {be or 'auto'}"
        try:
            attnkit.attention(q, k, v, backend=be, **varlen)
        except Exception as exc:  # a backend that does not serve the call here: said, not timed
            absent[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        fns[name] = (lambda be=be: attnkit.attention(q, k, v, backend=be, **varlen), g)
    runs: dict[str, Any] = {}
    for name, (fn, grad) in fns.items():
        runs[f"fwd {name}"] = fn
        runs[f"fwdbwd {name}"] = lambda fn=fn, grad=grad: fn().backward(grad)
    return runs, absent


def kernels(fn: Any) -> int | None:
    """CUDA kernels one step launches (None on the CPU)."""
    if DEV != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    rows = []
    for label, *dims in SHAPES if DEV == "cuda" else [("tiny x12 2-9 H2 D8", 12, 2, 9, 2, 8)]:
        runs, absent = candidates(*dims)
        for ps in ("fwd", "fwdbwd"):
            sel = {n[len(ps) + 1:]: f for n, f in runs.items() if n.split(" ", 1)[0] == ps}
            with torch.set_grad_enabled(ps == "fwdbwd"):
                _, errors = warm(sel, DEV, times=3)
                sel = {n: f for n, f in sel.items() if n not in errors}
                sync = interleaved(sel, DEV, iters=40, seed=1)
                b2b = interleaved(sel, DEV, iters=6, calls=20, seed=2)
                counts = {n: kernels(f) for n, f in sel.items()}
            row = {"shape": label, "pass": ps, "absent": absent, "errors": errors,
                   "us": {n: {"sync": round(sync[n] * 1e6, 1), "b2b": round(b2b[n] * 1e6, 1), "kernels": counts[n]}
                          for n in sel}}
            rows.append(row)
            base = row["us"]["plain"]
            print(f"{label} {ps}: " + "; ".join(
                f"{n} {t['sync']:.0f}/{t['b2b']:.0f} us ({t['sync'] / base['sync']:.2f}x/{t['b2b'] / base['b2b']:.2f}x"
                f"{'' if t['kernels'] is None else ', ' + str(t['kernels']) + ' kernels'})"
                for n, t in row["us"].items()), flush=True)
    report = {"what": __doc__.split("\n\n")[0], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "unit": "us per step, median; sync: a device sync after every step; b2b: 20 steps then one sync; "
                      "kernels: CUDA kernels one step launches",
              "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
