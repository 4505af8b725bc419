"""Where do attention()'s flex calls lose to torch's FlexAttention called as its documentation shows? On the H100 of
2026-12-08 (docs/results/2026-12-08-h100-tune-validate-session33-12-of-14-shapes.json), the held-out BLOOM ALiBi shape
(B2 H32 S2048 D128 causal, bf16) picked flex and ran 0.894 of the library call forward with a sync (0.445 against
0.399 ms: ~46 us more a call, where back to back the two were equal, 0.276 / 0.274 ms) and 0.91 back to back in
fwd+bwd (1.281 against 1.152 ms: the GPU's work, not the host's). The candidates differ in four places, and this
probe takes them one at a time, in one interleaved race per shape and pass (bench.timer.interleaved, a sync per
call, and back to back), with each form's CUDA kernels per step (profiler):
- `library`: torch.compile(flex_attention, dynamic=False) with the mods and block mask as bench/candidates.py
  builds them (the validate's `flex`);
- `library_attnkit_mask`: the same compiled call with attnkit's block mask (create_block_mask(_compile=True),
  broadcast over batch and heads): the block mask alone;
- `attnkit_entry`: attnkit's compiled entry point for this signature and size (runtime/backends/flex.py
  `entry_point`) with attnkit's mods (`mask_and_score`) and keyword dict, called directly: the mods and the
  entry, no dispatch;
- `attnkit_bound`: attnkit.bind(..., backend="flex") once, then the bound call: the runner, no lookup;
- `attention`: attention(..., backend="flex") as the validate's `attnkit:flex` calls it: the lookup too.
Writes JSON to argv[1]."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

import torch
from _probe import DEV, profiled_steps, write_report

from attnkit.bench.timer import b2b_calls, interleaved, sync_iters, warm, warm_gpu

# (label, B, H, S_q, S_k, D, dtype, train)
CASES = [
    ("BLOOM ALiBi B2 H32 S2048 D128 bf16 (held-out shape)", 2, 32, 2048, 2048, 128, "bfloat16", True),
    ("ALiBi train B8 H16 S2048 D128 bf16 (bench shape)", 8, 16, 2048, 2048, 128, "bfloat16", True),
    ("ALiBi chunk MHA B2 H16 Sq1024 Sk8192 D128 bf16 (bench shape)", 2, 16, 1024, 8192, 128, "bfloat16", True),
]
DRY = ("ALiBi tiny (CPU dry run)", 1, 2, 64, 64, 16, "float32", False)


def forms(b: int, h: int, sq: int, sk: int, d: int, dtype: str, grad: bool) -> tuple[dict[str, Any], Any]:
    """Each form as a no-argument call on the same (B, S, H, D) tensors, and the output gradient."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

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
    lib = torch.compile(flex_attention, dynamic=False) if DEV == "cuda" else flex_attention

    def library(bm: Any) -> Any:
        return lambda: lib(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                           block_mask=bm).transpose(1, 2)

    call, params = Inputs(q, k, v, causal=True, alibi_slopes=slopes).prepare()
    ak_mask_mod, ak_score_mod, q_len, kv_len = fx.mask_and_score(call, params, q.device)
    ak_mask = create_block_mask(ak_mask_mod, None, None, q_len, kv_len, device=DEV, _compile=DEV == "cuda")
    entry = fx.entry_point(("probe-flex-host", dtype, grad, sq, sk), (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    kw = {"score_mod": ak_score_mod, "scale": params.scale, "enable_gqa": False}
    bound = attnkit.bind(q, k, v, causal=True, alibi_slopes=slopes, backend="flex")
    runs = {
        "library": library(lib_mask),
        "library_attnkit_mask": library(ak_mask),
        "attnkit_entry": lambda: entry(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ak_mask,
                                       kw).transpose(1, 2),
        "attnkit_bound": lambda: bound(q, k, v),
        "attention": lambda: attention(q, k, v, causal=True, alibi_slopes=slopes, backend="flex"),
    }
    g = torch.randn(b, sq, h, d, device=DEV, dtype=dt, generator=gen) if grad else None
    return runs, (g, (q, k, v))


def kernels(fn: Any) -> dict[str, Any]:
    """The CUDA kernels one synced step launches (names, counts), and the host time from the step's start to its
    first kernel's launch, median over the profiled steps."""
    marks, events = profiled_steps(fn, steps=5)
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and "Launch" in str(e.get("name", ""))),
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


def one(label: str, b: int, h: int, sq: int, sk: int, d: int, dtype: str, train: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs, (g, tensors) = forms(b, h, sq, sk, d, dtype, train)
    row: dict[str, Any] = {"case": label}
    passes = {"fwd": None, **({"fwdbwd": g} if train else {})}
    for ps, grad_out in passes.items():
        def step(f: Any, grad_out: Any = grad_out) -> Any:
            def r() -> Any:
                for t in tensors:
                    t.grad = None
                if grad_out is None:
                    with torch.no_grad():
                        return f()
                out = f()
                out.backward(grad_out)
                return out
            return r
        steps = {n: step(f) for n, f in runs.items()}
        outs, errors = warm(steps, DEV)
        row.setdefault("compile_and_warm_s", round(time.perf_counter() - t0, 1))
        if errors:
            row[f"errors_{ps}"] = errors
        steps = {n: f for n, f in steps.items() if n not in errors}
        ref = outs.get("library")
        if ref is not None:
            row[f"max_diff_{ps}"] = {n: round((o.float() - ref.float()).abs().max().item(), 4)
                                     for n, o in outs.items() if n != "library"}
        if not steps:
            continue
        fast = min(interleaved(steps, DEV, iters=3).values())
        s = interleaved(steps, DEV, iters=sync_iters(fast, 12))
        bb = interleaved(steps, DEV, iters=12, calls=b2b_calls(fast))
        row[ps] = {n: {"sync_ms": round(s[n] * 1e3, 4), "b2b_ms": round(bb[n] * 1e3, 4)} for n in steps}
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
    rows = []
    for case in CASES if DEV == "cuda" else [DRY]:
        try:
            rows.append(one(*case))
        except Exception as e:  # one shape's failure is its row, not the probe's end
            rows.append({"case": case[0], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        r = rows[-1]
        print("case", r["case"], {k: v for k, v in r.items() if k.endswith("over_form") or k.startswith("error")},
              flush=True)
        write_report(__doc__, "ms per call (median); *_library_over_form: the library call's time / the form's "
                     "(below 1: the form is slower)", rows)


if __name__ == "__main__":
    sys.exit(main())
