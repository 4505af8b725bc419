"""What torch.compile costs a one-op graph of attention() against one of the plain SDPA call: the host us per call,
eager and compiled (fullgraph), with dynamo's guards evaluated and skipped, and how many guards each graph has.

Why: on the H100 (2026-12-06, session 19) compiling added 75-442 us to a synced attention() call and -318 to +510 us to
the plain call, and the profiles put more self time into dynamo's `compile_wrapper` for attention(). attention()'s
compiled graph carries ~7x the guards (dynamo traces the pytree flattening of its nonstrict_trace call). This measures
whether those guards cost time: a tiny call, so the host path is most of it; on the dev CPU it is a dry run of the
same question (the CPU kernel, not FA4's op).

Usage: python tools/probe-compiled-guards.py [report.json]
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch
import torch.nn.functional as F
from _probe import DEV, write_report

from attnkit.bench.timer import interleaved
from attnkit.runtime.attention import attention

CALLS, ROUNDS = 2000, 15


def block(fn: Any, args: tuple[Any, ...], skip_guards: bool) -> Any:
    """CALLS back-to-back calls of fn under one stance (the stance's context is entered once per block, not per
    call): one sample of bench.timer.interleaved, which shuffles the runs every round (this host's speed drifts by
    10-20% within a minute)."""
    def run() -> None:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards):
            for _ in range(CALLS):
                fn(*args)
    return run


def guard_count(fn: Any, args: tuple[Any, ...]) -> int:
    """The guards dynamo logs for fn compiled (fullgraph) after a dynamo reset."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    log = logging.getLogger("torch._dynamo.guards")
    torch._logging.set_logs(guards=True)
    log.addHandler(handler)
    try:
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=True)(*args)
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
    tree = buf.getvalue().split("TREE_GUARD_MANAGER:")[-1]  # the guard tree: one "+- " line per guard or accessor
    return len([ln for ln in tree.splitlines() if "+- " in ln and "GuardManager" not in ln])


def main() -> None:
    kw = {"causal": True}

    def attnkit_call(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, **kw)

    def plain_call(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    args = tuple(torch.randn(1, 4, 1, 8, device=DEV, dtype=dtype) for _ in range(3))
    calls = (("attention()", attnkit_call), ("plain", plain_call))
    with torch.no_grad():
        guards = {name: guard_count(fn, args) for name, fn in calls}
        torch._dynamo.reset()
        runs: dict[str, Any] = {}
        for name, fn in calls:
            compiled = torch.compile(fn, fullgraph=True)
            compiled(*args)
            runs[f"{name} eager"] = block(fn, args, False)
            runs[f"{name} compiled"] = block(compiled, args, False)
            runs[f"{name} compiled, guards skipped"] = block(compiled, args, True)
        us = {n: round(t / CALLS * 1e6, 2) for n, t in interleaved(runs, DEV, iters=ROUNDS).items()}
    rows = [{"call": name, "guards": guards[name], "eager_us": us[f"{name} eager"],
             "compiled_us": us[f"{name} compiled"], "compiled_guards_skipped_us": us[f"{name} compiled, guards skipped"]}
            for name in ("attention()", "plain")]
    for row in rows:
        print(row)
    write_report(__doc__, f"us per call, median of {ROUNDS} interleaved blocks of {CALLS} back-to-back calls, "
                 "a (1, 4, 1, 8) causal call", rows)


if __name__ == "__main__":
    main()
