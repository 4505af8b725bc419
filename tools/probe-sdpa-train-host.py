"""Where attnkit's host time goes in a training step on torch's own kernels, against the plain call a user writes.

The 2026-12-04 validate on the H200 timed attnkit's fwd+bwd through torch's SDPA kernels at 40-90 us per step over
the plain F.scaled_dot_product_attention call with the same kernel, with a sync after each step (Qwen2 H20/4
S1500: 686 vs 633 us; back to back 538 vs 530). Candidates, interleaved in one run (bench/timer.py), per shape:
- plain: F.scaled_dot_product_attention(q.transpose(1, 2), ..., is_causal=True[, enable_gqa=True]).transpose(1, 2)
- attention: attnkit.attention(q, k, v, causal=True, backend=B) as it is (B: sdpa, sdpa_cudnn)
- attention-nohook: the same with the cuDNN output-gradient relayout hook (_sdpa.grad_like_output) left out
- bound: attnkit.bind(...) once, then the bound call
Each timed forward-only and forward+backward, with a sync after each step and back to back.

    python tools/probe-sdpa-train-host.py [OUT.json]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _probe import DEV, write_report

import attnkit
from attnkit.bench.timer import interleaved, warm
from attnkit.runtime.backends import _sdpa

SHAPES = [  # (label, batch, heads, kv_heads, seqlen, head_dim, dtype): the validate shapes that train on SDPA
    ("Qwen2 H20/4 D128 S1500", 4, 20, 4, 1500, 128, torch.bfloat16),
    ("GPT-2-medium fp16 H16 D64 S1000", 8, 16, 16, 1000, 64, torch.float16),
    ("D96 H24 S1800", 8, 24, 24, 1800, 96, torch.bfloat16),
    ("small H16 D64 S512", 4, 16, 16, 512, 64, torch.bfloat16),
]
_HOOK = {"on": True}
_real_hook = _sdpa.grad_like_output


def _switchable(out: Any) -> Any:
    return _real_hook(out) if _HOOK["on"] else out


def candidates(b: int, h: int, hk: int, s: int, d: int, dtype: Any) -> dict[str, Any]:
    q = torch.randn(b, s, h, d, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    gqa = {"enable_gqa": True} if h != hk else {}

    def plain(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, **gqa).transpose(1, 2)

    fns: dict[str, Any] = {"plain": plain}
    for be in ("sdpa", "sdpa_cudnn") if DEV == "cuda" else ("sdpa",):
        fns[f"attention {be}"] = lambda q, k, v, be=be: attnkit.attention(q, k, v, causal=True, backend=be)

        def nohook(q: Any, k: Any, v: Any, be: str = be) -> Any:
            _HOOK["on"] = False
            try:
                return attnkit.attention(q, k, v, causal=True, backend=be)
            finally:
                _HOOK["on"] = True
        fns[f"attention-nohook {be}"] = nohook
        fns[f"bound {be}"] = attnkit.bind(q, k, v, causal=True, backend=be)
    g = torch.randn_like(q)
    out = {}
    for name, fn in fns.items():
        out[f"fwd {name}"] = lambda fn=fn: fn(q, k, v)
        out[f"fwdbwd {name}"] = lambda fn=fn: fn(q, k, v).backward(g)
    return out


def main() -> None:
    _sdpa.grad_like_output = _switchable
    rows = []
    for label, *dims in SHAPES if DEV == "cuda" else [("tiny", 1, 4, 2, 16, 8, torch.float32)]:
        runs = candidates(*dims)
        for ps in ("fwd", "fwdbwd"):
            sel = {n[len(ps) + 1:]: f for n, f in runs.items() if n.split(" ", 1)[0] == ps}
            with torch.set_grad_enabled(ps == "fwdbwd"):
                _, errors = warm(sel, DEV, times=3)
                sel = {n: f for n, f in sel.items() if n not in errors}
                sync = interleaved(sel, DEV, iters=40, seed=1)
                b2b = interleaved(sel, DEV, iters=6, calls=20, seed=2)
            row = {"shape": label, "pass": ps, "errors": errors,
                   "us": {n: {"sync": round(sync[n] * 1e6, 1), "b2b": round(b2b[n] * 1e6, 1)} for n in sel}}
            rows.append(row)
            base = row["us"]["plain"]
            print(f"{label} {ps}: " + "; ".join(
                f"{n} {t['sync']:.0f}/{t['b2b']:.0f} (+{t['sync'] - base['sync']:.0f}/+{t['b2b'] - base['b2b']:.0f})"
                for n, t in row["us"].items()), flush=True)
    write_report(__doc__, "us per step, median; sync: a device sync after every step; b2b: 20 steps then one sync",
                 rows)


if __name__ == "__main__":
    main()
