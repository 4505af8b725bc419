"""Where does a small call's time go? The same small SDPA call made several ways, timed interleaved per call with
a sync (host clock) and back to back, plus CUDA-event time of the kernel itself. Written to explain the first
H200 bench (2026-11-30): attnkit 15-45 us slower than the plain call per call with a sync on small shapes, yet
equal back to back. Prints and writes JSON (argv[1])."""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit.runtime.attention import _FAST
from attnkit.bench.run import environment

dev = "cuda"
shapes = {"B4 S256 D64 causal bf16": (4, 256, 16, 64), "B1 S128 D64 causal fp16": (1, 128, 8, 64)}
out: dict = {"environment": environment(), "shapes": {}}
for label, (b, s, h, d) in shapes.items():
    dt = torch.float16 if "fp16" in label else torch.bfloat16
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dt) for _ in range(3))

    def plain():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def via():
        return attnkit.attention(q, k, v, causal=True)

    def via_forced():
        return attnkit.attention(q, k, v, causal=True, backend="sdpa_cudnn")

    def direct_cudnn():
        return torch._scaled_dot_product_cudnn_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         None, False, 0.0, True, False)[0].transpose(1, 2)

    def wrapped_plain():  # a Python frame with the same amount of work as attention()'s lookup, then plain
        key = (q.shape, k.shape, v.shape, q.dtype, q.device, True, None, 0.0, None, 0.0, None,
               torch.is_grad_enabled() and q.requires_grad, False)
        _ = {key: 1}.get(key)
        return plain()

    with torch.no_grad():
        via()
        via_forced()
        runner = next(e[0] for key, e in _FAST.items() if key[0] == q.shape and key[10] is None)

        def runner_direct():
            return runner(q, k, v)

        runs = {"plain": plain, "attention": via, "attention_forced_cudnn": via_forced, "runner": runner_direct,
                "wrapped_plain": wrapped_plain, "direct_cudnn_op": direct_cudnn}
        for fn in runs.values():
            for _ in range(20):
                fn()
        torch.cuda.synchronize()
        res: dict = {n: {"sync": [], "b2b": [], "event": []} for n in runs}
        order = list(runs)
        rng = random.Random(0)
        for it in range(200):
            rng.shuffle(order)
            for n in order:
                fn = runs[n]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                res[n]["sync"].append(time.perf_counter() - t0)
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                e.record()
                e.synchronize()
                res[n]["event"].append(a.elapsed_time(e) / 1e3)
            if it % 20 == 0:
                for n in order:
                    fn = runs[n]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(100):
                        fn()
                    torch.cuda.synchronize()
                    res[n]["b2b"].append((time.perf_counter() - t0) / 100)
        # the same per-call sync timing with the garbage collector off
        gc.disable()
        for it in range(100):
            rng.shuffle(order)
            for n in order:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runs[n]()
                torch.cuda.synchronize()
                res[n].setdefault("sync_nogc", []).append(time.perf_counter() - t0)
        gc.enable()
    summary = {n: {m: round(statistics.median(v) * 1e6, 2) for m, v in r.items()} for n, r in res.items()}
    out["shapes"][label] = summary
    print(label)
    for n, r in summary.items():
        print(f"  {n:24s} " + "  ".join(f"{m} {x:8.2f} us" for m, x in r.items()))
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
