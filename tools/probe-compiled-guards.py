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
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from _probe import DEV, write_report

from attnkit.runtime.attention import attention

CALLS, ROUNDS = 2000, 15


def race(runs: dict[str, tuple[Any, bool]], args: tuple[Any, ...]) -> dict[str, float]:
    """Median us per call of each run (fn, guards skipped?) over ROUNDS blocks of CALLS back-to-back calls, the runs
    interleaved in a fresh order every round (this host's speed drifts by 10-20% within a minute)."""
    import random

    times: dict[str, list[float]] = {n: [] for n in runs}
    order = list(runs)
    for r in range(ROUNDS):
        random.Random(r).shuffle(order)
        for n in order:
            fn, skip = runs[n]
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                if DEV == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    fn(*args)
                if DEV == "cuda":
                    torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t0) / CALLS * 1e6)
    return {n: round(statistics.median(t), 2) for n, t in times.items()}


def guard_count(fn: Any, args: tuple[Any, ...]) -> tuple[Any, int]:
    """fn compiled (fullgraph) after a dynamo reset, called twice; the guard lines dynamo logged for it."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    log = logging.getLogger("torch._dynamo.guards")
    torch._logging.set_logs(guards=True)
    log.addHandler(handler)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        compiled(*args)
        compiled(*args)
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
    tree = buf.getvalue().split("TREE_GUARD_MANAGER:")[-1]  # the guard tree: one "+- " line per guard or accessor
    lines = [ln for ln in tree.splitlines() if "+- " in ln and "GuardManager" not in ln]
    return compiled, len(lines)


def main() -> None:
    kw = {"causal": True}

    def attnkit_call(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, **kw)

    def plain_call(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    args = tuple(torch.randn(1, 4, 1, 8, device=DEV, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        built = {name: guard_count(fn, args) for name, fn in (("attention()", attnkit_call), ("plain", plain_call))}
        for name, fn in (("attention()", attnkit_call), ("plain", plain_call)):  # every graph compiled: no reset
            built[name] = (torch.compile(fn, fullgraph=True), built[name][1])
            built[name][0](*args)
        runs: dict[str, tuple[Any, bool]] = {}
        for name, fn in (("attention()", attnkit_call), ("plain", plain_call)):
            runs[f"{name} eager"] = (fn, False)
            runs[f"{name} compiled"] = (built[name][0], False)
            runs[f"{name} compiled, guards skipped"] = (built[name][0], True)
        us = race(runs, args)
    rows = [{"call": name, "guards": built[name][1], "eager_us": us[f"{name} eager"],
             "compiled_us": us[f"{name} compiled"], "compiled_guards_skipped_us": us[f"{name} compiled, guards skipped"]}
            for name in ("attention()", "plain")]
    for row in rows:
        print(row)
    write_report(__doc__, f"us per call, median of {ROUNDS} interleaved blocks of {CALLS} back-to-back calls, "
                 "a (1, 4, 1, 8) causal call", rows)


if __name__ == "__main__":
    main()
