# ruff: noqa: B023  (each lambda is called within its own loop iteration)
"""FlashAttention-4's training path with its host path replayed (fa4_ops.eager_function: the forward through
fa4_replay.forward, the backward through fa4_replay.backward) on a GPU: is it right, and what does it save?

1. close: a grid of training calls (dtypes, head dims, MHA/GQA/MQA, causal, bottom-right causal, windows, softcap,
   packed varlen, deterministic), each forward + backward through attention(backend="flash_attn4") six times with
   the same inputs and output gradient (compile, record, verify, replay...). The last step's output must be BITWISE
   FA4's own `flash_attn_func` / `flash_attn_varlen_func` forward; its gradients must be within rounding of FA4's
   own backward (fa4_replay._close: dq, and GQA's dk / dv, are summed with float32 atomics, so two runs of FA4
   itself differ in the last bit: the same rule is applied to FA4 against itself, `fa4_self_close`).
2. speed: training calls (the held-out validate shapes that train, and grid points where cuDNN and FA4 cross),
   forward + backward, timed by bench/timer.py interleaved in one race: attention() as it selects, attention()
   on FA4 with the replays, on FA4 with them off (ATTNKIT_FA4_REPLAY=0 at call time: the runner bound first keeps
   attnkit's autograd.Function, whose forward and backward then run FA4's whole host path every step), FA4
   called directly (flash_attn_func + backward: what a user writes), cuDNN forced, and the plain SDPA call;
   per call with a sync and 20 back to back.
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

CLOSE = [  # label, b, h, hk, sq, sk, d, dtype, causal, window, softcap, deterministic
    ("MHA D128 S1024 causal bf16", 2, 16, 16, 1024, 1024, 128, "bf16", True, None, 0.0, False),
    ("MHA D64 S777 fp16", 3, 12, 12, 777, 777, 64, "fp16", False, None, 0.0, False),
    ("GQA 32/8 D128 S2000 causal", 1, 32, 8, 2000, 2000, 128, "bf16", True, None, 0.0, False),
    ("MQA 71/1 D64 S513 causal", 2, 71, 1, 513, 513, 64, "bf16", True, None, 0.0, False),
    ("D96 S900 causal", 2, 24, 24, 900, 900, 96, "bf16", True, None, 0.0, False),
    ("D256 S1500 causal fp16", 1, 8, 8, 1500, 1500, 256, "fp16", True, None, 0.0, False),
    ("D40 S1000 fp16", 2, 8, 8, 1000, 1000, 40, "fp16", False, None, 0.0, False),
    ("chunked Sq512 Sk2048 GQA causal", 2, 32, 8, 512, 2048, 128, "bf16", True, None, 0.0, False),
    ("window 256 S2048 causal", 2, 16, 16, 2048, 2048, 128, "bf16", True, (256, 0), 0.0, False),
    ("softcap 30 window D256 S2048", 1, 16, 8, 2048, 2048, 256, "bf16", True, (1023, 0), 30.0, False),
    ("deterministic GQA 32/8 D128 S1024", 2, 32, 8, 1024, 1024, 128, "bf16", True, None, 0.0, True),
]
VARLEN = [  # label, lengths, h, hk, d, causal
    ("varlen GQA 17-2048 causal", (17, 300, 2048, 1000, 64), 32, 8, 128, True),
    ("varlen MHA short 1-64", (1, 5, 64, 33, 2, 17, 64, 9), 16, 16, 64, False),
    # over FA4's BIN_BATCH_SEARCH_THRESH (256 sequences): its backward computes a tile cumsum first (one more launch)
    ("varlen GQA 300 sequences 1-200", tuple(1 + (i * 37) % 200 for i in range(300)), 16, 4, 64, True),
]
TIMED = [  # label, b, h, hk, sq, sk, d, dtype, causal
    ("val Llama-3-8B prefill S3000 GQA 32/8", 2, 32, 8, 3000, 3000, 128, "bf16", True),
    ("val Falcon-7B MQA 71/1 S2048", 4, 71, 1, 2048, 2048, 64, "bf16", True),
    ("val Qwen2 H20/4 D128 S1500 causal", 4, 20, 4, 1500, 1500, 128, "bf16", True),
    ("val Whisper enc S1500 D64 fp16", 16, 20, 20, 1500, 1500, 64, "fp16", False),
    ("val D96 train S1800", 8, 24, 24, 1800, 1800, 96, "bf16", True),
    ("grid GQA 32/8 D128 S1024 B2 causal", 2, 32, 8, 1024, 1024, 128, "bf16", True),
    ("grid MHA 16 D128 S2048 B1 causal", 1, 16, 16, 2048, 2048, 128, "bf16", True),
    ("grid MQA 16/1 D64 S4096 B2 causal", 2, 16, 1, 4096, 4096, 64, "bf16", True),
    ("grid GQA 32/4 D128 S4096 B1 causal", 1, 32, 4, 4096, 4096, 128, "bf16", True),
]


def direct_kw(causal: bool, sq: int, window, softcap: float, d: int, det: bool = False) -> dict:
    c, w = normalise_mask(causal, sq, window)  # what attnkit hands FA4
    kw = {"causal": c, "softmax_scale": d ** -0.5}
    if w is not None:
        kw["window_size"] = tuple(None if x < 0 else x for x in w)
    if softcap:
        kw["softcap"] = softcap
    if det:
        kw["deterministic"] = True
    return kw


def out_of(r):
    return r[0] if isinstance(r, tuple) else r


def grads(fn, tensors, dout):
    for t in tensors:
        t.grad = None
    out = out_of(fn())  # FA4's own functions return (out, lse)
    out.backward(dout)
    return out.detach(), [t.grad.clone() for t in tensors]


def compare(label: str, ours, theirs, tensors, det: bool = False) -> dict:
    fa4_replay.clear()
    row: dict = {"case": label}
    try:
        torch.use_deterministic_algorithms(det, warn_only=True)
        dout = torch.randn_like(out_of(theirs()).detach())
        for _ in range(6):
            out, g = grads(ours, tensors, dout)
        ref_out, ref_g = grads(theirs, tensors, dout)
        _, ref_g2 = grads(theirs, tensors, dout)  # FA4 against itself: what its atomics leave
        torch.cuda.synchronize()
        row.update(
            forward_bitwise_equal=bool(torch.equal(out, ref_out)),
            grads_close=[bool(fa4_replay._close(a, b)) for a, b in zip(g, ref_g, strict=True)],
            grads_bitwise_equal=[bool(torch.equal(a, b)) for a, b in zip(g, ref_g, strict=True)],
            fa4_self_close=[bool(fa4_replay._close(a, b)) for a, b in zip(ref_g2, ref_g, strict=True)],
            max_abs=[float((a.float() - b.float()).abs().max()) for a, b in zip(g, ref_g, strict=True)],
            fa4_self_max_abs=[float((a.float() - b.float()).abs().max()) for a, b in zip(ref_g2, ref_g, strict=True)],
            stats=fa4_replay.stats())
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        torch.use_deterministic_algorithms(False)
    print("close", json.dumps(row, default=str), flush=True)
    return row


def tensors(b, h, hk, sq, sk, d, dtype):
    g = torch.Generator(device=dev).manual_seed(b * 7 + sq)
    return [torch.randn(b, s, n, d, device=dev, dtype=DT[dtype], generator=g).requires_grad_()
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def close(fa) -> list[dict]:
    rows = []
    for label, b, h, hk, sq, sk, d, dtype, causal, window, softcap, det in CLOSE:
        q, k, v = tensors(b, h, hk, sq, sk, d, dtype)
        rows.append(compare(label, lambda: attnkit.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                                             backend="flash_attn4"),
                            lambda: fa.flash_attn_func(q, k, v, **direct_kw(causal, sq, window, softcap, d, det)),
                            (q, k, v), det))
    for label, lengths, h, hk, d, causal in VARLEN:
        total = sum(lengths)
        g = torch.Generator(device=dev).manual_seed(total)
        q, k, v = (torch.randn(total, n, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                   for n in (h, hk, hk))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        m = max(lengths)
        rows.append(compare(label, lambda: attnkit.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                             max_seqlen_q=m, max_seqlen_k=m, backend="flash_attn4"),
                            lambda: fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                                              max_seqlen_k=m, causal=causal, softmax_scale=d ** -0.5),
                            (q, k, v)))
    return rows


def off(fn):
    def run():
        os.environ[fa4_replay.ENV] = "0"
        try:
            return fn()
        finally:
            del os.environ[fa4_replay.ENV]
    return run


def time_shape(fa, label, b, h, hk, sq, sk, d, dtype, causal) -> dict:
    q, k, v = tensors(b, h, hk, sq, sk, d, dtype)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    fkw = direct_kw(causal, sq, None, 0.0, d)
    runs = {
        "attnkit": lambda: attnkit.attention(q, k, v, causal=causal),
        "attnkit:flash_attn4": lambda: attnkit.attention(q, k, v, causal=causal, backend="flash_attn4"),
        "attnkit:flash_attn4 replay off": off(lambda: attnkit.attention(q, k, v, causal=causal, backend="flash_attn4")),
        "flash_attn4_direct": lambda: out_of(fa.flash_attn_func(q, k, v, **fkw)),
        "attnkit:sdpa_cudnn": lambda: attnkit.attention(q, k, v, causal=causal, backend="sdpa_cudnn"),
        "sdpa_plain": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk),
    }
    dout = torch.randn(b, sq, h, d, device=dev, dtype=DT[dtype])
    dout_t = dout.transpose(1, 2)

    def step(name, fn):
        ts, g = ((qt, kt, vt), dout_t) if name == "sdpa_plain" else ((q, k, v), dout)

        def run():
            for t in ts:
                t.grad = None
            fn().backward(g)
        return run
    steps = {n: step(n, fn) for n, fn in runs.items()}
    row: dict = {"shape": label}
    try:
        for fn in steps.values():
            for _ in range(6):
                fn()
        torch.cuda.synchronize()
        res = {"sync": interleaved(steps, dev, iters=40, seed=0), "b2b": interleaved(steps, dev, iters=8, calls=20, seed=1)}
        row["ms"] = {n: {m: round(res[m][n] * 1e3, 4) for m in res} for n in steps}
        us = row["ms"]
        row["replayed_over_fa4_direct"] = {m: round(us["flash_attn4_direct"][m] / us["attnkit:flash_attn4"][m], 3)
                                           for m in res}
        row["replayed_over_replay_off"] = {m: round(us["attnkit:flash_attn4 replay off"][m]
                                                    / us["attnkit:flash_attn4"][m], 3) for m in res}
        row["fa4_replayed_over_cudnn"] = {m: round(us["attnkit:sdpa_cudnn"][m] / us["attnkit:flash_attn4"][m], 3)
                                          for m in res}
        row["attnkit_over_sdpa_plain"] = {m: round(us["sdpa_plain"][m] / us["attnkit"][m], 3) for m in res}
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("timed", json.dumps(row), flush=True)
    return row


def main() -> None:
    t0 = time.time()
    fa = loaders.load_fa4()
    warm_gpu(2.0)
    doc = {"what": __doc__, "environment": environment(), "close": close(fa)}
    doc["close_summary"] = {
        "cases": len(doc["close"]),
        "forward_bitwise_equal": sum(1 for r in doc["close"] if r.get("forward_bitwise_equal")),
        "grads_close": sum(1 for r in doc["close"] if r.get("grads_close") and all(r["grads_close"])),
        "backward_replayed": sum(1 for r in doc["close"] if r.get("stats", {}).get("bwd_replayed", 0) >= 2),
        "errors": sum(1 for r in doc["close"] if "error" in r)}
    print("summary", json.dumps(doc["close_summary"]), flush=True)
    doc["timed"] = [time_shape(fa, *spec) for spec in TIMED]
    doc["replay_stats_end"] = fa4_replay.stats()
    doc["seconds"] = round(time.time() - t0, 1)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
