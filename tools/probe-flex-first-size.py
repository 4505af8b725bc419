"""Is flex's compiled kernel slower for every size after the first? Until 2026-12-07 attnkit compiled flex once per
call signature (runtime/backends/flex.py `_compiled`), sizes left out: dynamo's automatic dynamic shapes made the
second size seen a dynamic graph, whose Triton kernel no longer knows the sequence lengths. The sweep (bench/tune.py)
times many sizes of one signature in one process, so only the first size of each signature timed a static kernel.

The H100 sweep of 2026-12-07 (docs/results/2026-12-07-h100-tune-session29-alibi-lm-15-cases.jsonl) fits that: in
the `alibi_lm` stage's chunk cells each signature's first level (2^35) had flex 1.1-1.25x faster than SDPA, and its
later levels (2^33, 2^37) 1.1-4.3x slower, twice over. Here, per shape, in one race (bench.timer.interleaved, a sync
per call, and back to back): flex compiled for this size only (dynamic=False), flex compiled by torch.compile's
default after one other size (what attnkit's entry point does in a process that saw two sizes), and the plain SDPA
call with the ALiBi bias built once (the baseline). Forward, and fwd+bwd where marked. Writes JSON to argv[1]."""

from __future__ import annotations

import sys
import time
import types
from typing import Any

import torch
from _probe import DEV, race, run_cases

from attnkit.bench.timer import warm, warm_gpu

# (label, B, H, Sq, Sk, D, dtype, train, the other size seen first: (B, Sq, Sk))
CASES = [
    ("ALiBi chunk MHA B2 H16 Sq1024 Sk8192 D128 bf16", 2, 16, 1024, 8192, 128, "bfloat16", False, (1, 2048, 16384)),
    ("ALiBi chunk MHA B1 H16 Sq1024 Sk8192 D64 fp16", 1, 16, 1024, 8192, 64, "float16", False, (1, 2048, 16384)),
    ("ALiBi chunk MHA B1 H16 Sq2048 Sk16384 D128 fp16", 1, 16, 2048, 16384, 128, "float16", False, (2, 1024, 8192)),
    ("ALiBi train B8 H16 S2048 D128 bf16", 8, 16, 2048, 2048, 128, "bfloat16", True, (8, 1024, 1024)),
    ("causal B4 H16 S4096 D128 bf16 (no ALiBi)", 4, 16, 4096, 4096, 128, "bfloat16", False, (4, 2048, 2048)),
]


def _entry(q: Any, k: Any, v: Any, block_mask: Any, score_mod: Any) -> Any:
    return _flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod)  # type: ignore[name-defined]  # noqa: F821


def entry(name: str, **compile_kw: Any) -> Any:
    """A compiled entry point of its own (its own code object, so its own dynamo cache), as attnkit makes one."""
    from torch.nn.attention.flex_attention import flex_attention

    code = _entry.__code__.replace(co_name=name)
    return torch.compile(types.FunctionType(code, {**_entry.__globals__, "_flex_attention": flex_attention}, name),
                         **compile_kw)


def mods(sq: int, sk: int, slopes: Any) -> tuple[Any, Any]:
    """The causal (lower-right) mask and the ALiBi score mod, the distance to the diagonal, as attnkit's."""
    off = sk - sq

    def mask_mod(b: Any, h: Any, qi: Any, kj: Any) -> Any:
        return kj <= qi + off

    def score_mod(score: Any, b: Any, h: Any, qi: Any, kj: Any) -> Any:
        return score - slopes[h] * (kj - (qi + off)).abs()
    return mask_mod, (score_mod if slopes is not None else None)


def inputs(b: int, h: int, sq: int, sk: int, d: int, dtype: str, alibi: bool, grad: bool) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import create_block_mask

    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, n, d, device=DEV, dtype=dt, requires_grad=grad) for n in (sq, sk, sk))
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1, device=DEV) / h)).float() if alibi else None
    mask_mod, score_mod = mods(sq, sk, slopes)
    bm = create_block_mask(mask_mod, None, None, sq, sk, device=DEV, _compile=DEV == "cuda")
    bias = None
    if alibi:  # the plain call's bias, built once: -slope * |j - (i + off)|, -inf above the diagonal
        i = torch.arange(sq, device=DEV)[:, None] + (sk - sq)
        j = torch.arange(sk, device=DEV)[None, :]
        bias = (-slopes[:, None, None] * (j - i).abs()[None]).masked_fill((j > i)[None], float("-inf")).to(dt)[None]
    return {"q": q, "k": k, "v": v, "bm": bm, "score_mod": score_mod, "bias": bias, "grad": grad}


def one(label: str, b: int, h: int, sq: int, sk: int, d: int, dtype: str, train: bool,
        other: tuple[int, int, int]) -> dict[str, Any]:
    import torch.nn.functional as F

    alibi = label.startswith("ALiBi")
    x = inputs(b, h, sq, sk, d, dtype, alibi, train)
    y = inputs(other[0], h, other[1], other[2], d, dtype, alibi, train)
    tag = abs(hash(label)) % 10**6
    static = entry(f"flex_static_{tag}", dynamic=False)
    auto = entry(f"flex_auto_{tag}")
    t0 = time.perf_counter()
    auto(y["q"], y["k"], y["v"], y["bm"], y["score_mod"])  # the other size first: the next one recompiles
    row: dict[str, Any] = {"case": label, "other_size_first": list(other)}

    def call(fn: Any, t: dict[str, Any]) -> Any:
        return fn(t["q"], t["k"], t["v"], t["bm"], t["score_mod"])

    def plain(t: dict[str, Any]) -> Any:
        if t["bias"] is None:
            return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True)
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["bias"])

    passes = {"fwd": None}
    if train:
        passes["fwdbwd"] = torch.randn(b, h, sq, d, device=DEV, dtype=getattr(torch, dtype))
    for ps, g in passes.items():
        def run(f: Any, g: Any = g) -> Any:
            def r() -> Any:
                out = f()
                if g is not None:
                    out.backward(g)
                return out
            return r
        runs = {"flex_this_size_only": run(lambda: call(static, x)),
                "flex_after_another_size": run(lambda: call(auto, x)),
                "sdpa_plain_bias_once" if alibi else "sdpa_plain_is_causal": run(lambda: plain(x))}
        outs, errors = warm(runs, DEV)
        row.setdefault("compile_and_warm_s", round(time.perf_counter() - t0, 1))
        runs = {n: f for n, f in runs.items() if n not in errors}
        if errors:
            row[f"errors_{ps}"] = errors
        ref = outs.get("flex_this_size_only")
        if ref is not None:
            row[f"max_diff_{ps}"] = {n: round((o.float() - ref.float()).abs().max().item(), 4)
                                     for n, o in outs.items() if n != "flex_this_size_only"}
        if not runs:
            continue
        row[ps] = race(runs)
        if "flex_this_size_only" in runs and "flex_after_another_size" in runs:
            row[f"{ps}_first_size_over_later"] = {m: round(row[ps]["flex_after_another_size"][m] /
                                                          row[ps]["flex_this_size_only"][m], 3)
                                                  for m in ("sync_ms", "b2b_ms")}
    return row


def main() -> None:
    from attnkit.runtime.backends.flex import allow_many_signatures

    allow_many_signatures()
    if DEV == "cuda":
        warm_gpu()
    run_cases(__doc__, "ms per call (median); *_first_size_over_later: later-size time / first-size time",
              CASES if DEV == "cuda" else [("ALiBi chunk tiny", 1, 2, 64, 256, 16, "float32", False, (1, 128, 256))],
              one, lambda k: k.endswith("later"))


if __name__ == "__main__":
    sys.exit(main())
