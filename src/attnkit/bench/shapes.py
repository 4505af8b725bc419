"""The bench's GPU suite and the CPU quick suite, as Shapes (the one call-spec type: runtime/shape.py)."""

from __future__ import annotations

import random
from typing import Any

from attnkit.runtime.shape import Shape, varlen

__all__ = ["Shape", "attn_flops", "mixed_lengths", "named", "suite", "varlen"]


def _varlen(label: str, lengths: tuple[int, ...], heads: int, kv_heads: int, d: int, **kw: Any) -> Shape:
    return varlen(label, lengths, heads=heads, kv_heads=kv_heads, head_dim=d, **kw)


def mixed_lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """n lengths drawn in [lo, hi] (seeded), the first one hi: packed batches as a collator makes them."""
    rng = random.Random(seed)
    out = [rng.randint(lo, hi) for _ in range(n)]
    out[0] = hi
    return tuple(out)


def suite(quick: bool) -> list[Shape]:
    """The GPU suite covers every call class the selection distinguishes; the quick one is a CPU sanity run."""
    if quick:
        return [Shape("tiny train fp32", 2, 4, 4, 128, 128, 64, "float32"),
                Shape("tiny GQA fp32", 2, 8, 2, 128, 128, 64, "float32", causal=False),
                Shape("tiny decode fp32", 4, 8, 2, 1, 256, 64, "float32", train=False),
                Shape("tiny prefill fp32", 2, 4, 4, 32, 128, 64, "float32", train=False),
                Shape("tiny window fp32", 2, 4, 4, 128, 128, 64, "float32", window=(16, 0)),
                _varlen("tiny varlen fp32", (100, 7, 60, 1), 4, 2, 32, dtype="float32")]
    return [
        # training, MHA / GQA, head dims 64-256, fp16 / bf16 / fp32, causal and not
        Shape("train MHA D128 S4096", 8, 16, 16, 4096, 4096, 128, causal=False),
        Shape("train MHA D128 S4096 causal", 8, 16, 16, 4096, 4096, 128),
        Shape("train GQA 32/8 D128 S4096 causal", 8, 32, 8, 4096, 4096, 128),
        Shape("train GQA 32/8 D128 S8192 causal", 2, 32, 8, 8192, 8192, 128),
        Shape("train MHA D128 S16384 causal", 1, 32, 32, 16384, 16384, 128),
        Shape("train fp16 D128 S2048 causal", 8, 16, 16, 2048, 2048, 128, "float16"),
        Shape("train D64 S1024 causal", 32, 32, 32, 1024, 1024, 64),
        Shape("train fp16 D64 S2048", 16, 16, 16, 2048, 2048, 64, "float16", causal=False),
        Shape("train D96 S2048 causal", 8, 16, 16, 2048, 2048, 96),
        Shape("train D256 S2048 causal", 4, 16, 16, 2048, 2048, 256),
        Shape("train fp32 D64 S2048 causal", 4, 16, 16, 2048, 2048, 64, "float32"),
        Shape("train fp32 GQA 16/4 D128 S1024", 4, 16, 4, 1024, 1024, 128, "float32", causal=False),
        # decode: one query (and speculative decoding's few) against a KV cache
        Shape("decode GQA 32/8 D128 Sk4096", 64, 32, 8, 1, 4096, 128, train=False),
        Shape("decode GQA 32/4 D128 Sk32768", 4, 32, 4, 1, 32768, 128, train=False),
        Shape("decode fp16 MHA D64 Sk1024", 128, 16, 16, 1, 1024, 64, "float16", train=False),
        Shape("spec-decode Sq4 Sk4096 GQA 32/8", 16, 32, 8, 4, 4096, 128, train=False),
        # small batch x short sequence: launch and host time decide
        Shape("small fp16 B1 S128 D64 causal", 1, 8, 8, 128, 128, 64, "float16"),
        Shape("small B4 S256 D64 causal", 4, 16, 16, 256, 256, 64, train=False),
        Shape("small fp16 B64 S256 D64", 64, 16, 16, 256, 256, 64, "float16", causal=False, train=False),
        # chunked prefill: fewer queries than keys, bottom-right causal
        Shape("prefill Sq512 Sk4096 GQA 32/8 D128", 4, 32, 8, 512, 4096, 128, train=False),
        Shape("prefill Sq2048 Sk8192 D128", 2, 16, 16, 2048, 8192, 128),
        # sliding window
        Shape("window 1024 S4096 D128 causal", 4, 16, 16, 4096, 4096, 128, window=(1024, 0)),
        Shape("window 4096 GQA 32/8 S16384 causal", 1, 32, 8, 16384, 16384, 128, window=(4096, 0)),
        Shape("window 256+256 S2048 D64", 8, 16, 16, 2048, 2048, 64, causal=False, window=(256, 256), train=False),
        # packed varlen with mixed lengths, very short ones included
        _varlen("varlen GQA 32/8 D128 17-4096 causal", mixed_lengths(16, 17, 4096, 0), 32, 8, 128),
        _varlen("varlen short 1-64 x256 D64 causal", mixed_lengths(256, 1, 64, 1), 16, 16, 64, train=False),
        # ALiBi (no FA4 kernel for it in attnkit): the causal training shape, and a causal chunk far from the
        # sweep's ALiBi points (2^35 and 2^37 work, fewer queries than keys), which the 'ALiBi' rows decide since 2026-12-07
        Shape("ALiBi train D128 S2048 causal", 8, 16, 16, 2048, 2048, 128, alibi=True),
        Shape("ALiBi prefill Sq1024 Sk8192 D128 causal", 2, 16, 16, 1024, 8192, 128, alibi=True),
        Shape("ALiBi prefill Sq2048 Sk16384 GQA 32/8 D128 causal", 1, 32, 8, 2048, 16384, 128, alibi=True),
        # cross-attention: more queries than keys
        Shape("cross Sq4096 Sk512 D64", 8, 16, 16, 4096, 512, 64, causal=False),
        Shape("cross fp16 Sq1024 Sk77 D64", 16, 8, 8, 1024, 77, 64, "float16", causal=False, train=False),
    ]


def named(shapes: list[Shape], only: list[str] | None) -> list[Shape]:
    """The shapes `--shape` names (all when none), in suite order; an unknown label is one line listing the known."""
    if not only:
        return shapes
    from attnkit.errors import UsageError

    known = {s.label for s in shapes}
    for label in only:
        if label not in known:
            raise UsageError(f"--shape: unknown shape {label!r}; known: {', '.join(sorted(known))}")
    return [s for s in shapes if s.label in only]


def attn_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs (two matmuls); causal counts only the visible half when sq == sk."""
    f = 4.0 * batch * heads * sq * sk * d
    if causal and sq == sk:
        f /= 2
    return f
