"""Where a compiled attention() call's host time goes on the GPU machine, Python frame by frame.

`bench --compiled` on the H100 (2026-12-06) had compiled attention() on FlashAttention-4 at 0.64 of eager with a sync
on the prefill Sq512 Sk4096 shape (+178 us a call) while torch.compile cost the plain SDPA call +67 us, and the
window 1024 fwd+bwd step at 0.71 (+490 us). This probe profiles synced steps of eager attention(), compiled
attention() and the plain SDPA call compiled, with Python stacks, and reports per step: the host time before the
first kernel launch, and the Python functions with the most inclusive and self time (us per step).

    python tools/probe-compiled-host-stack.py [OUT.json]
"""

from __future__ import annotations

import collections
import re
import statistics
from typing import Any

import torch
from _probe import DEV, profiled_steps, write_report

from attnkit.bench.candidates import Case
from attnkit.bench.compiled import compiled_pair
from attnkit.bench.shapes import named, suite
from attnkit.bench.timer import warm_gpu

SHAPES = [("prefill Sq512 Sk4096 GQA 32/8 D128", "fwd"), ("window 1024 S4096 D128 causal", "fwdbwd")]
STEPS, TOP = 20, 30
_ADDR = re.compile(r" (object )?at 0x[0-9a-f]+|pybind11_builtins\.pybind11_detail_function_record_\w+ ")
LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def profile_steps(fn: Any) -> dict[str, Any]:
    steps, events = profiled_steps(fn, STEPS, with_stack=True)
    py = [{**e, "name": _ADDR.sub("", e["name"])} for e in events if e.get("cat") == "python_function"]
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCH]
    incl: collections.Counter[str] = collections.Counter()
    self_t: collections.Counter[str] = collections.Counter()
    first_launch, walls = [], []
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        walls.append(s["dur"])
        ls = [e["ts"] - t0 for e in launches if t0 <= e["ts"] <= t1]
        if ls:
            first_launch.append(min(ls))
        inside = sorted((e for e in py if t0 <= e["ts"] and e["ts"] + e["dur"] <= t1), key=lambda e: (e["tid"], e["ts"]))
        stack: list[tuple[Any, float]] = []  # (event, time spent in its children)
        for e in inside:  # self time: a frame's duration less its direct children's, per thread
            while stack and (stack[-1][0]["tid"] != e["tid"] or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, kids = stack.pop()
                self_t[done["name"]] += done["dur"] - kids
            if stack:
                stack[-1] = (stack[-1][0], stack[-1][1] + e["dur"])
            stack.append((e, 0.0))
            incl[e["name"]] += e["dur"]
        while stack:
            done, kids = stack.pop()
            self_t[done["name"]] += done["dur"] - kids
    n = max(len(steps), 1)
    return {"steps": len(steps), "wall_us": round(statistics.median(walls), 1) if walls else None,
            "first_launch_us": round(statistics.median(first_launch), 1) if first_launch else None,
            "launches_per_step": round(len([e for e in launches if steps and steps[0]["ts"] <= e["ts"]]) / n, 1),
            "inclusive_us": [(k[:140], round(v / n, 1)) for k, v in incl.most_common(TOP)],
            "self_us": [(k[:140], round(v / n, 1)) for k, v in self_t.most_common(TOP)]}


def one_shape(label: str, ps: str) -> dict[str, Any]:
    """Eager attention(), compiled attention() and the plain SDPA call eager and compiled, each profiled."""
    if DEV == "cuda":
        s = named(suite(False), [label])[0]
    else:  # a dry run of the probe itself
        from attnkit.bench.shapes import Shape
        s = Shape("tiny", 1, 2, 2, 16, 16, 8)
    c = Case(s, DEV)
    grad = ps == "fwdbwd"
    c.call(grad)
    f, compiled, plain_compiled = compiled_pair(c)
    fns = {"eager": lambda: f(c.q, c.k, c.v), "compiled": lambda: compiled(c.q, c.k, c.v),
           "plain_eager": lambda: c.plain(c.q, c.k, c.v), "plain_compiled": lambda: plain_compiled(c.q, c.k, c.v)}
    if grad:
        fns = {n: c.step(fn, n) for n, fn in fns.items()}
    row: dict[str, Any] = {"shape": label, "pass": ps, "candidates": {}}
    with torch.set_grad_enabled(grad):
        for name, fn in fns.items():
            for _ in range(5):
                fn()
            r = row["candidates"][name] = profile_steps(fn)
            print(f"{label} {ps} {name}: wall {r['wall_us']} first launch {r['first_launch_us']} "
                  f"launches {r['launches_per_step']}", flush=True)
            for k, v in r["self_us"][:8]:
                print(f"    self {v:8.1f}  {k}", flush=True)
    return row


def main() -> None:
    if DEV == "cuda":
        warm_gpu()
    rows = [one_shape(label, ps) for label, ps in (SHAPES if DEV == "cuda" else [("tiny", "fwdbwd")])]
    write_report(__doc__, "us per synced step under torch.profiler (with_stack: slower than unprofiled; compare "
                 "within a row)", rows)


if __name__ == "__main__":
    main()
