"""Where do attention()'s flex calls lose to torch's FlexAttention called as its documentation shows? On the H100 of
2026-12-08 (docs/results/2026-12-08-h100-tune-validate-session33-12-of-14-shapes.json), the held-out BLOOM ALiBi shape
(B2 H32 S2048 D128 causal, bf16) picked flex, and attention()'s own pick ran 0.894 of the library call forward with a
sync (0.4455 against 0.3985 ms: 47 us more a call, where back to back it was 0.279 against 0.274 ms) and 0.91 back
to back in fwd+bwd (1.266 against 1.152 ms: the GPU's work, not the host's). The calls differ in a few places, and
this probe takes them one at a time, in one interleaved race per shape and pass (bench.timer.interleaved, a sync
per call, and back to back), with each form's CUDA kernel launches per step (profiler) and, in fwd+bwd, its
gradients against the library call's. Each pass builds its own tensors (requires_grad only in fwd+bwd) and
bindings, as the validate does:
- `library`: torch.compile(flex_attention, dynamic=False) with the mods and block mask as bench/candidates.py
  builds them (the validate's `flex`), on a code object of its own (its own dynamo cache);
- `library_attnkit_mask`: the same compiled call, on another code object, with attnkit's block mask
  (create_block_mask(_compile=True), broadcast over batch and heads): the block mask alone;
- `attnkit_entry`: attnkit's compiled entry point for this signature and size (runtime/backends/flex.py
  `entry_point`) with attnkit's mods (`mask_and_score`) and keyword dict, called directly: the mods and the
  entry, no dispatch;
- `attnkit_bound`: attnkit.bind(..., backend="flex") once, then the bound call: the runner, no lookup;
- `attention`: attention(..., backend="flex") as the validate's `attnkit:flex` calls it: the lookup too;
- `attention_auto`: attention() with no backend named, the validate's `attnkit` row (its own pick, flex there).
Writes JSON to argv[1]; each case's row as it lands (a compile is ~15-20 s; FLEXHOST_S=300 may reach 1-2 cases)."""

from __future__ import annotations

import sys
import time
import types
from collections import Counter
from typing import Any

import torch
from _probe import DEV, profiled_steps, race, run_cases

from attnkit.bench.timer import warm, warm_gpu

# (label, B, H, S_q, S_k, D, dtype, train)
CASES = [
    ("BLOOM ALiBi B2 H32 S2048 D128 bf16 (held-out shape)", 2, 32, 2048, 2048, 128, "bfloat16", True),
    ("ALiBi train B8 H16 S2048 D128 bf16 (bench shape)", 8, 16, 2048, 2048, 128, "bfloat16", True),
    ("ALiBi chunk MHA B2 H16 Sq1024 Sk8192 D128 bf16 (bench shape)", 2, 16, 1024, 8192, 128, "bfloat16", True),
]
DRY = ("ALiBi tiny (CPU dry run)", 1, 2, 64, 64, 16, "float32", False)
LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def _entry(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any) -> Any:
    return _flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)  # type: ignore[name-defined]  # noqa: F821


def library_entry(name: str) -> Any:
    """torch.compile(flex_attention, dynamic=False) on a code object of its own: its own dynamo cache, so that one
    form's guards are never checked on another form's call."""
    from torch.nn.attention.flex_attention import flex_attention

    code = _entry.__code__.replace(co_name=name)
    fn = types.FunctionType(code, {**_entry.__globals__, "_flex_attention": flex_attention}, name)
    return torch.compile(fn, dynamic=False) if DEV == "cuda" else fn


def forms(b: int, h: int, sq: int, sk: int, d: int, dtype: str, grad: bool) -> tuple[dict[str, Any], Any, Any, str]:
    """Each form as a no-argument call on the same (B, S, H, D) tensors (requiring grad when `grad`), the output
    gradient (None without grad), the tensors, and the backend attention()'s own pick runs (`attention_auto`
    races the library call only where that is flex)."""
    from torch.nn.attention.flex_attention import create_block_mask

    import attnkit
    from attnkit.runtime.attention import attention
    from attnkit.runtime.backends import flex as fx
    from attnkit.runtime.call import Inputs

    dt = getattr(torch, dtype)
    gen = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device=DEV, dtype=dt, generator=gen).requires_grad_(grad)
               for n in (sq, sk, sk))
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1, device=DEV) / h)).float()
    off = sk - sq

    def mask_mod(b_: Any, h_: Any, i: Any, j: Any) -> Any:  # as bench/candidates.py writes them
        return j <= i + off

    def score_mod(score: Any, b_: Any, h_: Any, i: Any, j: Any) -> Any:
        return score - slopes[h_] * (j - i - off).abs()

    lib_mask = create_block_mask(mask_mod, None, None, sq, sk, device=DEV)
    tag = f"{b}_{h}_{sq}_{sk}_{d}_{dtype}_{int(grad)}"

    def library(name: str, bm: Any) -> Any:
        fn = library_entry(f"{name}_{tag}")
        return lambda: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod, bm).transpose(1, 2)

    call, params = Inputs(q, k, v, causal=True, alibi_slopes=slopes).prepare()
    ak_mask_mod, ak_score_mod, q_len, kv_len = fx.mask_and_score(call, params, q.device)
    ak_mask = create_block_mask(ak_mask_mod, None, None, q_len, kv_len, device=DEV, _compile=DEV == "cuda")
    entry = fx.entry_point(("probe-flex-host", tag), (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    kw = {"score_mod": ak_score_mod, "scale": params.scale, "enable_gqa": False}
    bound = attnkit.bind(q, k, v, causal=True, alibi_slopes=slopes, backend="flex")
    runs = {
        "library": library("library", lib_mask),
        "library_attnkit_mask": library("library_attnkit_mask", ak_mask),
        "attnkit_entry": lambda: entry(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ak_mask,
                                       kw).transpose(1, 2),
        "attnkit_bound": lambda: bound(q, k, v),
        "attention": lambda: attention(q, k, v, causal=True, alibi_slopes=slopes, backend="flex"),
        "attention_auto": lambda: attention(q, k, v, causal=True, alibi_slopes=slopes),
    }
    g = torch.randn(b, sq, h, d, device=DEV, dtype=dt, generator=gen) if grad else None
    return runs, g, (q, k, v), attnkit.bind(q, k, v, causal=True, alibi_slopes=slopes).backend.name


def kernels(fn: Any) -> dict[str, Any]:
    """The kernel launches of one synced step (runtime or driver API: Triton launches through the driver), the host
    time from the step's start to its first launch (median over the profiled steps), and the last step's kernels."""
    marks, events = profiled_steps(fn, steps=5)
    launches = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCH),
                      key=lambda e: e["ts"])
    per_step, to_first = [], []
    for m in marks:
        inside = [e for e in launches if m["ts"] <= e["ts"] <= m["ts"] + m["dur"]]
        per_step.append(len(inside))
        if inside:
            to_first.append(inside[0]["ts"] - m["ts"])
    last = marks[-1]
    names = Counter(str(e["name"])[:80] for e in events if e.get("cat") == "kernel"
                    and last["ts"] <= e["ts"] <= last["ts"] + last["dur"] + 5e4)
    to_first.sort()
    return {"launches_per_step": per_step, "host_us_to_first_launch": to_first[len(to_first) // 2] if to_first else None,
            "kernels_last_step": dict(names)}


def max_diffs(steps: dict[str, Any], tensors: Any, grad: bool) -> dict[str, Any]:
    """Each form once more: max |form - library| of its output, and of dq, dk, dv with `grad`."""
    n_out = 4 if grad else 1
    ref: Any = None
    diffs: dict[str, Any] = {"order": ["out", "dq", "dk", "dv"][:n_out]}
    for n in ("library", *(m for m in steps if m != "library")):
        out = steps[n]()
        got = (out.detach().float(), *(t.grad.float() for t in tensors if grad))
        if ref is None:
            ref = got
        else:
            diffs[n] = [round((a - e).abs().max().item(), 4) for a, e in zip(got, ref, strict=True)]
    return diffs


def one(label: str, b: int, h: int, sq: int, sk: int, d: int, dtype: str, train: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"case": label}
    for ps in ("fwd", "fwdbwd") if train else ("fwd",):
        t0 = time.perf_counter()
        runs, g, tensors, own = forms(b, h, sq, sk, d, dtype, ps == "fwdbwd")
        row[f"own_pick_{ps}"] = own

        def step(f: Any, g: Any = g, tensors: Any = tensors) -> Any:
            def run() -> Any:
                for t in tensors:
                    t.grad = None
                out = f()
                if g is not None:
                    out.backward(g)
                return out
            return run
        steps = {n: step(f) for n, f in runs.items()}
        _, errors = warm(steps, DEV)
        row[f"compile_and_warm_s_{ps}"] = round(time.perf_counter() - t0, 1)
        if errors:
            row[f"errors_{ps}"] = errors
        steps = {n: f for n, f in steps.items() if n not in errors}
        if "library" in steps:
            try:
                row[f"max_diff_{ps}"] = max_diffs(steps, tensors, g is not None)
            except Exception as e:  # the race still runs; the check's failure is its entry
                row[f"max_diff_{ps}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if not steps:
            continue
        row[ps] = race(steps)
        if "library" in steps:
            row[f"{ps}_library_over_form"] = {n: {m: round(row[ps]["library"][m] / row[ps][n][m], 3)
                                                  for m in ("sync_ms", "b2b_ms")} for n in steps if n != "library"}
        if DEV == "cuda":
            row[f"{ps}_profile"] = {n: kernels(f) for n, f in steps.items()}
    return row


def main() -> None:
    from attnkit.runtime.backends.flex import for_measurement

    for_measurement()  # every size its own compiled kernel, as the validate and the bench time them
    if DEV == "cuda":
        warm_gpu()
    run_cases(__doc__, "ms per call (median); *_library_over_form: the library call's time / the form's (below 1: the "
              "form is slower); max_diff_*: max |form - library| of the output (and dq, dk, dv)",
              CASES if DEV == "cuda" else [DRY], one, lambda k: k.endswith("over_form"))


if __name__ == "__main__":
    sys.exit(main())
