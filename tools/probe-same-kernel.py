"""Is attnkit's pick slower than SDPA's default at S16384 D128 causal (the bench's lowest selected/SDPA-default
ratio), or is it noise? Times attnkit, SDPA's default and attnkit with backend="sdpa_cudnn" forced, fwd+bwd,
interleaved (attnkit.bench.timer.interleaved), 4 rounds of 40, then lists the CUDA kernels each one runs.

Run on the GPU machine:  python3 tools/probe-same-kernel.py OUT.json
Result on the H200 (docs/results/2026-11-30-h200-s16384-same-kernel.json): the same four cuDNN kernels for
attnkit and SDPA's default; default/attnkit per round 1.0014, 0.9949, 0.9981, 0.9957 and default/forced
1.0004, 0.9966, 1.0022, 1.0011: the spread of one kernel timed twice.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from attnkit.runtime.attention import attention
import torch.nn.functional as F

from attnkit.bench.timer import interleaved, warm_gpu


def _sdpa_default(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """The plain SDPA call, torch's own kernel choice, in attnkit's (B, S, H, D) layout."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def main() -> None:
    warm_gpu()
    q, k, v = (torch.randn(2, 16384, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)

    def fb(run: Any) -> Any:
        def step() -> None:
            q.grad = k.grad = v.grad = None
            run().backward(g)
        return step

    runs = {"attnkit": fb(lambda: attention(q, k, v, causal=True)),
            "sdpa_default": fb(lambda: _sdpa_default(q, k, v, True)),
            "forced_sdpa_cudnn": fb(lambda: attention(q, k, v, causal=True, backend="sdpa_cudnn"))}
    out: dict[str, Any] = {"rounds": []}
    for _ in range(4):
        t, _errors = interleaved(runs, "cuda", iters=40)
        row: dict[str, float] = {n: round(x * 1e3, 4) for n, x in t.items()}
        row["default_over_attnkit"] = round(t["sdpa_default"] / t["attnkit"], 4)
        row["default_over_forced"] = round(t["sdpa_default"] / t["forced_sdpa_cudnn"], 4)
        out["rounds"].append(row)
        print(row, flush=True)
    for name in ("attnkit", "sdpa_default"):
        runs[name]()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runs[name]()
            torch.cuda.synchronize()
        kernels = sorted(((e.key, round(e.device_time_total / 1e3, 3), e.count) for e in prof.key_averages()
                          if e.device_time_total > 0), key=lambda x: -x[1])
        out[f"kernels_{name}"] = kernels[:8]
        print(name, kernels[:8], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
