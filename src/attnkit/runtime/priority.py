"""Which backend attnkit tries first: per GPU architecture AND per call class, kept as data with the
measurement each row comes from. The fastest kernel depends on the call, not only on the GPU: on the H200
FlashAttention-4 wins sliding windows, packed varlen, chunked prefill and long training calls, while torch's
own SDPA pick wins decode and small calls, where host time decides (shared/FACTS.md and the bench reports
named in each row's `source`).

Selection (select.py) walks `order_for(call, capability)`: the first row whose architecture range and
`when` conditions match puts its backends first, followed by the architecture's full default order, so a
row never hides a backend; the first backend whose limits allow the call serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnkit.runtime.call import AttentionCall

DECODE_MAX_QUERIES = 16  # a decode step, or speculative decoding verifying a few tokens
SMALL_WORK = 1 << 33  # batch*heads*Sq*Sk*head_dim below this: kernels of tens of us, where host time decides

SM90 = ((9, 0), (9, 0))
BLACKWELL = ((10, 0), (12, 9))

# Full default order per architecture (first row whose minimum the GPU meets), and on CPU.
DEFAULTS: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((10, 0), ("sdpa_cudnn", "cudnn_ragged", "flash_attn4", "sdpa_cudnn_varlen", "flash_attn2", "sdpa_flash",
               "torch_varlen", "xformers", "sdpa", "sdpa_efficient", "sdpa_math")),
    ((9, 0), ("sdpa_cudnn", "cudnn_ragged", "sdpa_cudnn_varlen", "flash_attn3", "flash_attn4", "flash_attn2",
              "sdpa_flash", "torch_varlen", "xformers", "sdpa", "sdpa_efficient", "sdpa_math")),
    ((8, 0), ("flash_attn2", "sdpa_flash", "torch_varlen", "sdpa_cudnn", "xformers", "sdpa", "sdpa_efficient",
              "sdpa_math")),
    ((0, 0), ("xformers", "sdpa_efficient", "sdpa", "sdpa_math")),
)
CPU_DEFAULT: tuple[str, ...] = ("sdpa_cpu", "sdpa", "sdpa_math")


@dataclass(frozen=True)
class Features:
    """The call class: the properties of a call that change which kernel is fastest."""

    varlen: bool
    window: bool
    decode: bool  # at most DECODE_MAX_QUERIES queries per sequence
    fewer_queries: bool  # causal with fewer queries than keys: chunked prefill, a prompt against a KV cache
    more_queries: bool  # more queries than keys: cross-attention to a short context
    small: bool  # below SMALL_WORK: launch and host time dominate
    train: bool  # a backward will follow
    dtype: str
    head_dim: int


def features(call: AttentionCall) -> Features:
    return Features(
        varlen=call.varlen,
        window=call.window is not None,
        decode=call.seqlen_q <= DECODE_MAX_QUERIES,
        fewer_queries=call.causal and call.seqlen_q < call.seqlen_k,
        more_queries=call.seqlen_q > call.seqlen_k,
        small=call.work < SMALL_WORK,
        train=call.requires_grad,
        dtype=call.dtype,
        head_dim=max(call.head_dim, call.head_dim_v),
    )


@dataclass(frozen=True)
class Row:
    """`order` goes first for calls on GPUs in `arch` whose features match every entry of `when`: a bool or
    str must be equal; a (low, high) pair bounds a number, both ends included."""

    label: str
    arch: tuple[tuple[int, int], tuple[int, int]]
    order: tuple[str, ...]
    source: str
    when: dict[str, Any] = field(default_factory=dict)

    def matches(self, f: Features, capability: tuple[int, int]) -> bool:
        if not self.arch[0] <= capability <= self.arch[1]:
            return False
        for name, want in self.when.items():
            have = getattr(f, name)
            if isinstance(want, tuple):
                if not want[0] <= have <= want[1]:
                    return False
            elif have != want:
                return False
        return True


FACTS = "shared/FACTS.md 'FlashAttention-4 (flash-attn-4 on PyPI) on the H200' (2026-11-30)"
BENCH = "docs/results/2026-11-30-h200-bench.json"

ROWS: tuple[Row, ...] = (
    Row("packed varlen", SM90, ("flash_attn4", "cudnn_ragged", "sdpa_cudnn_varlen", "flash_attn3", "flash_attn2"),
        f"{FACTS}: FA4 2.1x cudnn_ragged, 2.7x padded SDPA; {BENCH}: 'varlen *' shapes", {"varlen": True}),
    Row("decode", SM90, ("sdpa",),
        f"{FACTS}: FA4 0.5-0.9x on decode (no split-KV on sm90); {BENCH}: 'decode *' shapes, torch's own pick "
        "is the plain call with no host cost added", {"decode": True}),
    Row("small", SM90, ("sdpa",),
        f"{FACTS}: attnkit 0.1.0 1.3-1.5x slower than the plain call on a 43 us kernel, FA4 slower still; "
        f"{BENCH}: 'small *' shapes", {"small": True}),
    Row("sliding window", SM90, ("flash_attn4", "flash_attn3", "flash_attn2"),
        f"{FACTS}: FA4 4-6x SDPA with a dense mask; {BENCH}: 'window *' shapes", {"window": True}),
    Row("chunked prefill", SM90, ("flash_attn4", "sdpa"),
        f"{FACTS}: FA4 1.2-1.4x; without FA4 torch's own pick is its native bottom-right flash kernel, 15-40% "
        f"faster than cuDNN with a materialised lower-right mask; {BENCH}: 'prefill *' shapes",
        {"fewer_queries": True}),
    Row("training D128", SM90, ("flash_attn4",),
        f"{FACTS}: FA4 1.10-1.15x fwd+bwd on long D128 MHA and GQA; {BENCH}: 'train * D128' shapes",
        {"train": True, "head_dim": (128, 128), "dtype": "bfloat16"}),
    Row("training D128 fp16", SM90, ("flash_attn4",), f"as 'training D128'; {BENCH}: 'train fp16 * D128'",
        {"train": True, "head_dim": (128, 128), "dtype": "float16"}),
    # Blackwell: FA4's primary target, not measured here (no such GPU lent); windows and packed varlen have no
    # native cuDNN path through SDPA (dense masks, padding), so FA4 goes first there too.
    Row("packed varlen (Blackwell)", BLACKWELL, ("flash_attn4", "cudnn_ragged"),
        "not measured here: assumed as on sm90 (FA4's kernels are Blackwell-first)", {"varlen": True}),
    Row("sliding window (Blackwell)", BLACKWELL, ("flash_attn4",),
        "not measured here: assumed as on sm90 (SDPA needs a dense mask)", {"window": True, "decode": False}),
)


def default_order(call: AttentionCall, capability: tuple[int, int] | None) -> tuple[str, ...]:
    if call.device != "cuda":
        return CPU_DEFAULT
    cap = capability or (0, 0)
    return next(order for minimum, order in DEFAULTS if cap >= minimum)


def order_for(call: AttentionCall, capability: tuple[int, int] | None) -> tuple[tuple[str, ...], Row | None]:
    """The order to try backends in for `call`, and the row that put its first entries there (None: the
    architecture's default order)."""
    base = default_order(call, capability)
    if call.device != "cuda" or capability is None:
        return base, None
    f = features(call)
    for row in ROWS:
        if row.matches(f, capability):
            return (*row.order, *(n for n in base if n not in row.order)), row
    return base, None
