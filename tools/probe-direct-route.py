"""Host us per call of the routes a bound SDPA call can take to torch's kernel, on tiny shapes: the plain
F.scaled_dot_product_attention call, the kernel's op called directly (what runtime/backends/_sdpa.py `_direct`
does), attention() and its bound runner.

Why: on the H100 (2026-12-06, session 20) attention() took 4.8-5.0 us over the plain call on a tiny shape and its
bound runner 1.4-1.8 us, though the bound runner calls the kernel's op directly and so skips the plain call's
per-call kernel choice. The op returns its whole tuple (out, log-sum-exp, philox state, ...) to Python, which the
plain call keeps in C++. This measures which route is cheaper, per kernel, forward alone and with grad.

Usage: python tools/probe-direct-route.py [report.json]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _probe import DEV, write_report

from attnkit.bench.timer import interleaved
from attnkit.runtime import dispatch
from attnkit.runtime.attention import attention

CALLS, ROUNDS = 1000, 15


def loop(fn: Any) -> Any:
    def run() -> None:
        for _ in range(CALLS):
            fn()
    return run


def routes(q: Any, k: Any, v: Any, grad: bool) -> dict[str, Any]:
    runs: dict[str, Any] = {
        "plain": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        is_causal=True).transpose(1, 2),
        "attention": lambda: attention(q, k, v, causal=True),
    }
    bound = dispatch.bind(q, k, v, causal=True)
    runs["bound"] = lambda: bound(q, k, v)
    if DEV == "cuda":
        flash, cudnn = torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten._scaled_dot_product_cudnn_attention
        runs["flash_op"] = lambda: flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True,
                                         False)[0].transpose(1, 2)
        runs["flash_fn"] = lambda: torch._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False)[0].transpose(1, 2)
        runs["cudnn_fn"] = lambda: torch._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, grad, 0.0, True, False)[0].transpose(1, 2)
        runs["cudnn_op"] = lambda: cudnn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, grad, 0.0,
                                         True, False)[0].transpose(1, 2)
    return runs


def main() -> None:
    rows = []
    for d, s in ((64, 2), (64, 128), (128, 256)):
        for grad in (False, True):
            dt = torch.bfloat16 if DEV == "cuda" else torch.float32
            q, k, v = (torch.randn(1, s, 16, d, device=DEV, dtype=dt, requires_grad=grad) for _ in range(3))
            with torch.set_grad_enabled(grad):
                runs = routes(q, k, v, grad)
                errors: dict[str, str] = {}
                ok = {}
                for name, fn in runs.items():
                    try:
                        fn()
                        ok[name] = loop(fn)
                    except Exception as exc:  # a kernel that does not take this call
                        errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                us = {n: round(t * 1e6 / CALLS, 2) for n, t in interleaved(ok, DEV, iters=ROUNDS, seed=1).items()}
            b = next((x for x in dispatch.bound_calls() if x.call.seqlen_q == s and x.call.head_dim == d
                      and x.call.requires_grad == grad), None)
            row = {"shape": f"B1 S{s} H16 D{d} causal bf16", "grad": grad, "us_per_call": us,
                   "over_plain": {n: round(x - us["plain"], 2) for n, x in us.items()},
                   "bound_route": getattr(b.runner, "__qualname__", "?") if b else None, "errors": errors}
            print(row, flush=True)
            rows.append(row)
    write_report(__doc__, f"host us per call: {CALLS} calls back to back then a sync, median of {ROUNDS} shuffled "
                          "rounds (bench.timer.interleaved)", rows)


if __name__ == "__main__":
    main()
