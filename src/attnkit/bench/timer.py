"""THE timer of attnkit's measurements (bench, tune, autotune, the integrations' bench): calls timed on the host's
clock with a device sync around each sample, candidates interleaved in a fresh random order every iteration, the
median reported. Two modes: `calls=1` (latency: host cost counts) and `calls=N` back to back (throughput)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from attnkit.errors import first_line


def sync(device: str) -> None:
    """Wait for the device (a no-op on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def warm(runs: dict[str, Callable[[], Any]], device: str, times: int = 2,
         seconds: dict[str, float] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Call each candidate `times` times (JIT compiles happen here, never inside a timed sample); returns the
    first output of each and the error of each candidate that raised (a result, not a crash). `seconds` gets each
    candidate's warm time (the sweep's cases spent 70% of their time warming on the H200, 2026-12-02)."""
    outs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        try:
            for i in range(times):
                out = fn()
                if i == 0:
                    outs[name] = out
            sync(device)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {first_line(exc)}"
            sync(device)
        if seconds is not None:
            seconds[name] = round(time.perf_counter() - t0, 3)
    return outs, errors


def interleaved(runs: dict[str, Callable[[], Any]], device: str, iters: int, calls: int = 1,
                seed: int = 0) -> dict[str, float]:
    """Median seconds per call of each candidate, on the host's clock, `calls` calls then one device sync per
    sample (calls=1: latency; calls=N: back-to-back throughput). Every iteration times every candidate once,
    in a fresh random order: a rotation would keep each candidate behind the same predecessor, and a kernel
    that runs right after a slow, low-power one gets the power headroom (measured on the H200: 604 vs 540
    TFLOP/s for one cuDNN kernel, 2026-11-30)."""
    samples: dict[str, list[float]] = {n: [] for n in runs}
    order = list(runs)
    shuffle = random.Random(seed).shuffle
    for _ in range(iters):
        shuffle(order)
        for n in order:
            fn = runs[n]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            samples[n].append((time.perf_counter() - t0) / calls)
    return {n: statistics.median(v) for n, v in samples.items()}


def b2b_calls(fastest_s: float) -> int:
    """Calls per back-to-back sample: ~4 ms of the fastest candidate, at least 20 (the issues' outside
    measurement: 20 calls back to back) and at most 200. With 3 calls, a 1.5 ms call's sample carried a third
    of its first call's host latency, which torch.compile's wrappers make 100-150 us longer (H100, 2026-12-06).
    Calls over 5 ms take fewer, down to 3, so that a sample stays near 100 ms (the sweep's largest cases): there
    a first call's latency is under 0.5% of the sample."""
    t = max(1e-6, fastest_s)
    return max(min(20, max(3, int(0.1 / t))), min(200, int(4e-3 / t)))


def sync_iters(fastest_s: float, base: int) -> int:
    """Samples per candidate with a sync per call: `base`, raised for short calls to ~50 ms of the fastest one
    (at most 10x `base`). A 50-100 us call's synced time moved by 10-25% between candidates that run one kernel
    on the same route (H100, 2026-12-06 bench: attnkit's own pick and the same backend forced), at 12 samples."""
    return max(base, min(10 * base, int(0.05 / max(1e-6, fastest_s))))


def median_seconds(run: Callable[[], Any], device: str, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of `run()` alone (a sync after each call), after `warmup` calls (JIT compiles)."""
    for _ in range(warmup):
        run()
    sync(device)
    return interleaved({"run": run}, device, iters=iters)["run"]


def warm_gpu(seconds: float = 3.0) -> None:
    """Run matmuls until clocks settle, so the first shapes are not measured on a cold GPU."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
