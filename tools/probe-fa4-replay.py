# ruff: noqa: B023  (each lambda is called by compare() within its own loop iteration)
"""FlashAttention-4's forward replay (runtime/backends/fa4_replay.py) on a GPU: is it exact, and what does it save?

1. exact: a grid of forward calls (dtypes, head dims, GQA/MQA, causal, bottom-right causal, windows, softcap,
   decode, packed varlen, inputs with odd strides), each through attention(backend="flash_attn4") six times under
   no_grad (compile, record, verify, replay...), the last replayed output compared BITWISE with FA4's own
   `flash_attn_func` / `flash_attn_varlen_func` given the same arguments; the replay's counters and refusal reasons.
2. speed: the held-out validate shapes whose forward attnkit sends to FA4 and a few bench calls, timed by
   bench/timer.py interleaved in one race (shuffled order each iteration): attention() with the replay,
   attention() with it off (ATTNKIT_FA4_REPLAY=0 for that call), FA4 called directly, and the plain SDPA call a
   user writes; per call with a sync and 50 back to back.
Writes JSON to argv[1] (and prints one line a case)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit.bench.run import environment
from attnkit.bench.timer import interleaved, warm_gpu
from attnkit.runtime import loaders
from attnkit.runtime.backends import fa4_replay
from attnkit.runtime.call import normalise_mask

dev = "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def direct_kw(causal: bool, sq: int, window, softcap: float, d: int) -> dict:
    c, w = normalise_mask(causal, sq, window)  # what attnkit hands FA4
    kw = {"causal": c, "softmax_scale": d ** -0.5}
    if w is not None:
        kw["window_size"] = tuple(None if x < 0 else x for x in w)
    if softcap:
        kw["softcap"] = softcap
    return kw


EXACT = [  # label, b, h, hk, sq, sk, d, dtype, causal, window, softcap, layout
    ("MHA D128 S1024 causal bf16", 2, 16, 16, 1024, 1024, 128, "bf16", True, None, 0.0, "bshd"),
    ("MHA D64 S777 fp16", 3, 12, 12, 777, 777, 64, "fp16", False, None, 0.0, "bshd"),
    ("GQA 32/8 D128 S2000 causal", 1, 32, 8, 2000, 2000, 128, "bf16", True, None, 0.0, "bshd"),
    ("MQA 71/1 D64 S513", 2, 71, 1, 513, 513, 64, "bf16", True, None, 0.0, "bshd"),
    ("D96 S900 causal", 2, 24, 24, 900, 900, 96, "bf16", True, None, 0.0, "bshd"),
    ("D256 S1500 causal fp16", 1, 8, 8, 1500, 1500, 256, "fp16", True, None, 0.0, "bshd"),
    ("D40 S1000 fp16", 2, 8, 8, 1000, 1000, 40, "fp16", False, None, 0.0, "bshd"),
    ("decode GQA Sk4096", 16, 32, 8, 1, 4096, 128, "bf16", True, None, 0.0, "bshd"),
    ("spec decode Sq5 Sk3000", 8, 32, 8, 5, 3000, 128, "bf16", True, None, 0.0, "bshd"),
    ("chunked prefill Sq512 Sk4096", 2, 32, 8, 512, 4096, 128, "bf16", True, None, 0.0, "bshd"),
    ("window 256 S2048", 2, 16, 16, 2048, 2048, 128, "bf16", True, (256, 0), 0.0, "bshd"),
    ("window both 128 S1024 fp16", 2, 8, 8, 1024, 1024, 64, "fp16", False, (128, 128), 0.0, "bshd"),
    ("softcap 30 window D256 S2048", 1, 16, 8, 2048, 2048, 256, "bf16", True, (1023, 0), 30.0, "bshd"),
    ("softcap 50 D128 S1024", 2, 8, 8, 1024, 1024, 128, "bf16", True, None, 50.0, "bshd"),
    ("q from a bhsd layout (strided)", 2, 16, 16, 1024, 1024, 128, "bf16", True, None, 0.0, "bhsd"),
    ("cross Sq300 Sk1200 not causal", 4, 16, 4, 300, 1200, 128, "bf16", False, None, 0.0, "bshd"),
]
VARLEN = [  # label, lengths, h, hk, d, causal
    ("varlen GQA 17-2048 causal", (17, 300, 2048, 1000, 64), 32, 8, 128, True),
    ("varlen MHA short 1-64", (1, 5, 64, 33, 2, 17, 64, 9), 16, 16, 64, False),
]
TIMED = [  # label, b, h, hk, sq, sk, d, dtype, causal, window, softcap (tune.validation_shapes' rows + bench)
    ("val Llama-3-8B prefill S3000 GQA 32/8", 2, 32, 8, 3000, 3000, 128, "bf16", True, None, 0.0),
    ("val Falcon-7B MQA 71/1 S2048", 4, 71, 1, 2048, 2048, 64, "bf16", True, None, 0.0),
    ("val Gemma2 softcap window D256 S4096", 1, 16, 8, 4096, 4096, 256, "bf16", True, (4095, 0), 50.0),
    ("val Mistral window decode Sk8000", 32, 32, 8, 1, 8000, 128, "bf16", True, (4096, 0), 0.0),
    ("val spec decode Sq5 Sk6000", 16, 32, 8, 5, 6000, 128, "bf16", True, None, 0.0),
    ("decode GQA 32/8 D128 Sk4096 B8", 8, 32, 8, 1, 4096, 128, "bf16", True, None, 0.0),
    ("prefill Sq512 Sk4096 GQA 32/8", 1, 32, 8, 512, 4096, 128, "bf16", True, None, 0.0),
    ("window 1024 S4096 D128 causal B8", 8, 16, 16, 4096, 4096, 128, "bf16", True, (1024, 0), 0.0),
]


def tensors(b, h, hk, sq, sk, d, dtype, layout="bshd"):
    g = torch.Generator(device=dev).manual_seed(b * 7 + sq)
    if layout == "bhsd":
        q = torch.randn(b, h, sq, d, device=dev, dtype=DT[dtype], generator=g).transpose(1, 2)
    else:
        q = torch.randn(b, sq, h, d, device=dev, dtype=DT[dtype], generator=g)
    k, v = (torch.randn(b, sk, hk, d, device=dev, dtype=DT[dtype], generator=g) for _ in range(2))
    return q, k, v


def compare(label: str, ours, theirs) -> dict:
    """attention() six times (compile, record, verify, replay...), its last output against FA4's own call."""
    fa4_replay.clear()
    row: dict = {"case": label}
    try:
        with torch.no_grad():
            for _ in range(6):
                out = ours()
            ref = theirs()
            ref = ref[0] if isinstance(ref, tuple) else ref
        torch.cuda.synchronize()
        row.update(bitwise_equal=bool(torch.equal(out, ref)), max_abs=float((out.float() - ref.float()).abs().max()),
                   stats=fa4_replay.stats())
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("exact", json.dumps(row, default=str), flush=True)
    return row


def exact(fa) -> list[dict]:
    rows = []
    for label, b, h, hk, sq, sk, d, dtype, causal, window, softcap, layout in EXACT:
        q, k, v = tensors(b, h, hk, sq, sk, d, dtype, layout)
        rows.append(compare(label, lambda: attnkit.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                                             backend="flash_attn4"),
                            lambda: fa.flash_attn_func(q, k, v, **direct_kw(causal, sq, window, softcap, d))))
    for label, lengths, h, hk, d, causal in VARLEN:
        total = sum(lengths)
        g = torch.Generator(device=dev).manual_seed(total)
        q = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        m = max(lengths)
        rows.append(compare(label, lambda: attnkit.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                             max_seqlen_q=m, max_seqlen_k=m, backend="flash_attn4"),
                            lambda: fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                                              max_seqlen_k=m, causal=causal, softmax_scale=d ** -0.5)))
    return rows


def off(fn):
    def run():
        os.environ[fa4_replay.ENV] = "0"
        try:
            return fn()
        finally:
            del os.environ[fa4_replay.ENV]
    return run


def timed(fa) -> list[dict]:
    return [time_shape(fa, *spec) for spec in TIMED]


def time_shape(fa, label, b, h, hk, sq, sk, d, dtype, causal, window, softcap) -> dict:
    q, k, v = tensors(b, h, hk, sq, sk, d, dtype)
    kw = {"causal": causal, "window": window, "softcap": softcap}
    fkw = direct_kw(causal, sq, window, softcap, d)
    mask = None
    if window is not None:  # the plain call's mask, built once (bottom-right window)
        i = torch.arange(sq, device=dev)[:, None] + (sk - sq)
        j = torch.arange(sk, device=dev)[None, :]
        mask = (j <= i) & (j >= i - window[0])
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def plain():
        if softcap:
            return None  # no plain SDPA call has softcap
        if mask is not None:
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=h != hk)
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal and sq == sk and sq > 1,
                                              enable_gqa=h != hk)
    runs = {
        "attnkit": lambda: attnkit.attention(q, k, v, **kw),
        "attnkit:flash_attn4": lambda: attnkit.attention(q, k, v, backend="flash_attn4", **kw),
        "attnkit:flash_attn4 replay off": off(lambda: attnkit.attention(q, k, v, backend="flash_attn4", **kw)),
        "flash_attn4_direct": lambda: fa.flash_attn_func(q, k, v, **fkw),
    }
    if not softcap and (sq == sk or sq == 1 or mask is not None):
        runs["sdpa_plain"] = plain
    row = {"shape": label}
    try:
        with torch.no_grad():
            for fn in runs.values():
                for _ in range(6):
                    fn()
            torch.cuda.synchronize()
            res = {"sync": interleaved(runs, dev, iters=100, seed=0),
                   "b2b": interleaved(runs, dev, iters=10, calls=50, seed=1)}
        row["us"] = {n: {m: round(res[m][n] * 1e6, 2) for m in res} for n in runs}
        base = row["us"]["flash_attn4_direct"]
        row["replay_speedup_over_fa4_direct"] = {m: round(base[m] / row["us"]["attnkit:flash_attn4"][m], 3)
                                                 for m in res}
        if "sdpa_plain" in row["us"]:
            row["attnkit_over_sdpa_plain"] = {m: round(row["us"]["sdpa_plain"][m] / row["us"]["attnkit"][m], 3)
                                              for m in res}
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("timed", json.dumps(row), flush=True)
    return row


def lenient(rows: list[dict]) -> dict:
    """If the strict op check refused cases for ops FA4's host path ran, which ops, and whether those cases
    replay bitwise-exact once the ops are allowed (data for widening _ALLOWED_OPS; nothing ships from this)."""
    ops = set()
    for r in rows:
        for why in r.get("stats", {}).get("refusals", []):
            if why.startswith("FlashAttention-4's host path ran "):
                ops |= {o.strip() for o in why.split(" ran ")[1].split(":")[0].split(",")}
    if not ops:
        return {"ops": []}
    saved = fa4_replay._ALLOWED_OPS
    fa4_replay._ALLOWED_OPS = saved | ops
    try:
        again = exact(loaders.load_fa4())
    finally:
        fa4_replay._ALLOWED_OPS = saved
    return {"ops": sorted(ops), "rows": again}


def main() -> None:
    t0 = time.time()
    fa = loaders.load_fa4()
    warm_gpu(2.0)
    doc = {"what": __doc__, "environment": environment(), "exact": exact(fa)}
    doc["lenient"] = lenient(doc["exact"])
    doc["timed"] = timed(fa)
    doc["replay_stats_end"] = fa4_replay.stats()
    doc["seconds"] = round(time.time() - t0, 1)
    doc["exact_summary"] = {"cases": len(doc["exact"]),
                            "bitwise_equal": sum(1 for r in doc["exact"] if r.get("bitwise_equal")),
                            "replayed": sum(1 for r in doc["exact"] if r.get("stats", {}).get("replayed", 0) > 0),
                            "errors": sum(1 for r in doc["exact"] if "error" in r)}
    print("summary", json.dumps(doc["exact_summary"]), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
