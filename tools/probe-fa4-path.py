"""Why does attention()'s own FlashAttention-4 pick time below FA4 forced through attention(), and below FA4 called
directly, on some held-out shapes (2026-12-02 validate: Gemma2 softcap+window 0.84 back to back, Mistral windowed
decode 0.85, speculative decode 0.83 per call with a sync), when on the CPU both paths cost the same?

For each shape: the three calls timed interleaved in shuffled order, per call with a sync (host clock) and back to
back (100 calls), forward only; the bound call each signature got (backend, the call attnkit saw); and a cProfile
of 300 back-to-back calls of each, top functions by own time. Prints and writes JSON (argv[1]).
Run on a GPU with FA4 installed, after its kernels for these shapes are cached (the session's validate phase).
(docs/results/2026-12-02-h200-fa4-path-probe.json came from the first version, whose direct call passed
causal=True for the one-query shapes, as attnkit does not, and which had a copy of the same interleaved loop
that bench/timer.py `interleaved` now runs for it.)"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys

import torch

import attnkit
from attnkit.bench.run import environment
from attnkit.bench.timer import interleaved
from attnkit.runtime import dispatch, loaders
from attnkit.runtime.call import normalise_mask

dev = "cuda"
SHAPES = {  # (batch, heads, kv_heads, sq, sk, head_dim, window, softcap): tune.validation_shapes' rows
    "Gemma2 softcap window D256 S4096": (1, 16, 8, 4096, 4096, 256, (4095, 0), 50.0),
    "Mistral window decode Sk8000": (32, 32, 8, 1, 8000, 128, (4096, 0), 0.0),
    "spec decode Sq5 Sk6000": (16, 32, 8, 5, 6000, 128, None, 0.0),
}


def top(fn, n: int = 300, rows: int = 14) -> list[str]:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(rows)
    return [ln for ln in s.getvalue().splitlines() if ln.strip()][-rows - 1:]


def shape(label: str, b: int, h: int, hk: int, sq: int, sk: int, d: int, window, softcap: float, fa) -> dict:
    q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    kw = {"causal": True, "window": window, "softcap": softcap}
    # what attnkit passes FA4 (runtime/call.py normalise_mask): one causal query is an unmasked decode
    causal, win = normalise_mask(True, sq, window)
    fkw = {"causal": causal, "softmax_scale": d ** -0.5}
    if win is not None:
        fkw["window_size"] = win
    if softcap:
        fkw["softcap"] = softcap
    runs = {
        "attnkit": lambda: attnkit.attention(q, k, v, **kw),
        "attnkit:flash_attn4": lambda: attnkit.attention(q, k, v, backend="flash_attn4", **kw),
        "flash_attn4_direct": lambda: fa.flash_attn_func(q, k, v, **fkw),
    }
    with torch.no_grad():
        for fn in runs.values():
            for _ in range(10):
                fn()
        torch.cuda.synchronize()
        bound = [{"backend": bc.backend.name, "call": repr(bc.call)} for bc in dispatch.bound_calls()
                 if bc.call.seqlen_k == sk and bc.call.head_dim == d]
        # the bench's own timer: shuffled order each iteration, medians (10 samples of 100 calls back to back)
        res = {"sync": interleaved(runs, "cuda", iters=120, seed=0),
               "b2b": interleaved(runs, "cuda", iters=10, calls=100, seed=1)}
        profiles = {n: top(fn) for n, fn in runs.items()}
    summary = {n: {m: round(res[m][n] * 1e6, 2) for m in res} for n in runs}
    print(label, json.dumps(summary), json.dumps(bound)[:600], flush=True)
    return {"us": summary, "bound": bound, "profile_top_tottime": profiles}


def main() -> None:
    fa = loaders.load_fa4()
    out: dict = {"environment": environment(), "shapes": {}}
    for label, spec in SHAPES.items():
        out["shapes"][label] = shape(label, *spec, fa)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
