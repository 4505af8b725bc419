"""Which backend attnkit tries first where no measured table decides (runtime/table.py: tables that
`attnkit tune` writes take precedence): per GPU architecture AND per call class, kept as data with the
measurement each row comes from. The fastest kernel depends on the call, not only on the GPU: on the H200
FlashAttention-4 wins sliding windows, packed varlen, chunked prefill and long training calls, while torch's
own SDPA pick wins decode and small calls, where host time decides (the bench reports
named in each row's `source`).

Selection (select.py) walks `order_for(call, capability)`: the first row whose architecture range and
`when` conditions match puts its backends first, followed by the architecture's full default order, so a
row never hides a backend; the first backend whose limits allow the call serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnkit.runtime import table
from attnkit.runtime.call import AttentionCall
from attnkit.runtime.table import Decision

# Thresholds on the call's work (batch*heads*Sq*Sk*head_dim), read off the H200 bench (BENCH below): FA4's kernels
# are faster, but its Python interface costs ~80 us more host time per call than torch's SDPA, so it wins per call
# (with a sync) only where its kernel saves more than that.
SMALL_WORK = 1 << 33  # below: kernels of tens of us, host time decides: torch's own SDPA pick
FA4_TRAIN_WORK_SMALL_D = 1 << 35  # head_dim <= 96 training: FA4 ahead from here (D64 S1024 B32 H32, D96 S2048 B8 H16)
FA4_TRAIN_WORK_D128 = 1 << 37  # head_dim 128 training: fp16 S2048 B8 H16 (2^36) was a tie, S4096 B8 H16 (2^38) FA4
FA4_PREFILL_WORK = 1 << 29  # causal, fewer queries than keys: 'spec-decode Sq4' (2^30) FA4 3.3x; below: unmeasured
FA4_INFER_WORK_D128 = 1 << 39  # head_dim 128 forward only: GQA S4096 B8 H32 (2^39) FA4, MHA S4096 B8 H16 (2^38) cuDNN

SM90 = ((9, 0), (9, 0))
BLACKWELL = ((10, 0), (12, 9))

# Full default order per architecture (first row whose minimum the GPU meets), and on CPU.
# sdpa_cudnn_varlen (varlen only) comes after the native varlen kernels: it splits, pads and joins on the host per
# sequence, ~25-35 us a sequence forward and 70-90 us fwd+bwd (H100, 2026-12-05,
# docs/results/2026-12-05-h100-probe-varlen-padded-fa2-direct.json: 7-30x the plain padded call at 64-400
# sequences); it won only with few long sequences (16 x <= 4096: 10.8 ms fwd+bwd against torch_varlen's 14.5 on
# its old custom-op path, docs/results/2026-11-30-h200-bench-1.json)
DEFAULTS: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((10, 0), ("sdpa_cudnn", "cudnn_ragged", "flash_attn4", "flash_attn2", "sdpa_flash", "torch_varlen",
               "sdpa_cudnn_varlen", "xformers", "flex_flash", "flex", "sdpa", "sdpa_efficient", "sdpa_math")),
    ((9, 0), ("sdpa_cudnn", "cudnn_ragged", "flash_attn3", "flash_attn4", "flash_attn2", "sdpa_flash", "torch_varlen",
              "sdpa_cudnn_varlen", "xformers", "flex_flash", "flex", "sdpa", "sdpa_efficient", "sdpa_math")),
    ((8, 0), ("flash_attn2", "sdpa_flash", "torch_varlen", "sdpa_cudnn", "xformers", "flex", "sdpa",
              "sdpa_efficient", "sdpa_math")),
    ((0, 0), ("xformers", "sdpa_efficient", "sdpa", "sdpa_math")),
)
CPU_DEFAULT: tuple[str, ...] = ("sdpa_cpu", "sdpa", "sdpa_math", "flex")  # flex: packed varlen in a graph


@dataclass(frozen=True)
class Features:
    """The call class: the properties of a call that change which kernel is fastest."""

    varlen: bool
    window: bool
    decode: bool  # one query per sequence: a decode step against a KV cache
    fewer_queries: bool  # causal with fewer queries than keys: chunked prefill, a prompt against a KV cache
    more_queries: bool  # more queries than keys: cross-attention to a short context
    small: bool  # below SMALL_WORK: launch and host time dominate
    train: bool  # a backward will follow
    alibi: bool
    softcap: bool
    dtype: str
    head_dim: int
    work: int  # batch * heads * seqlen_q * seqlen_k * head_dim


def features(call: AttentionCall) -> Features:
    return Features(
        varlen=call.varlen,
        window=call.window is not None,
        decode=call.seqlen_q == 1,
        fewer_queries=call.causal and call.seqlen_q < call.seqlen_k,
        more_queries=call.seqlen_q > call.seqlen_k,
        small=call.work < SMALL_WORK,
        train=call.requires_grad,
        alibi=call.alibi,
        softcap=call.softcap,
        dtype=call.dtype,
        head_dim=max(call.head_dim, call.head_dim_v),
        work=call.work,
    )


@dataclass(frozen=True)
class Row:
    """`order` goes first for calls on GPUs in `arch` whose features match every entry of `when`: a bool must
    be equal; a tuple of str lists the allowed values; a (low, high) pair of ints bounds a number, both ends
    included."""

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
            if isinstance(want, tuple) and want and isinstance(want[0], str):
                if have not in want:
                    return False
            elif isinstance(want, tuple):
                if not want[0] <= have <= want[1]:
                    return False
            elif have != want:
                return False
        return True


# the run the rows were read from; docs/results/2026-11-30-h200-bench.json is the run with these rows in place
BENCH = "docs/results/2026-11-30-h200-bench-1.json"
FLEX = "docs/results/2026-12-01-h200-flex-alibi.json"  # flex vs SDPA on ALiBi, measured from outside the project
TUNED = "docs/results/2026-12-03-h200-tune-table-522-cases.json"  # the sweep's table: float32 ALiBi cells
HALF = ("bfloat16", "float16")
BIG = 1 << 62

ROWS: tuple[Row, ...] = (
    Row("packed varlen, short sequences", SM90, ("torch_varlen", "cudnn_ragged", "flash_attn4"),
        f"{BENCH}: 'varlen short 1-64 x256 D64': torch_varlen 0.119 ms back to back, padded SDPA 0.132, "
        "cudnn_ragged 0.165, FA4 0.287", {"varlen": True, "work": (0, SMALL_WORK - 1)}),
    Row("packed varlen", SM90, ("flash_attn4", "cudnn_ragged", "flash_attn3", "torch_varlen", "flash_attn2",
                                "sdpa_cudnn_varlen"),
        f"{BENCH}: 'varlen GQA 32/8 D128 17-4096': FA4 7.2 ms fwd+bwd, cudnn_ragged "
        "8.3, padded SDPA 49; then the native varlen kernels ahead of sdpa_cudnn_varlen's per-sequence host work "
        "(DEFAULTS)", {"varlen": True}),
    Row("decode", SM90, ("sdpa",),
        f"{BENCH}: 'decode *': torch's own pick (cuDNN) is fastest; FA4 has no split-KV on sm90 (0.36 vs 0.07 ms "
        f"at Sk=32768); a windowed decode is not this row's: SDPA needs a mask there, FA4 a key range ({FLEX}: "
        "FA4 0.48 ms); half precision only, like every row read off that bench: float32 goes to the 'float32' row "
        f"({TUNED}: flex, next in the default order where SDPA cannot run, is 500x slower there)",
        {"decode": True, "window": False, "dtype": HALF}),
    Row("ALiBi training", SM90, ("flex",),
        f"{FLEX}: ALiBi causal B8 S2048 H16 D128 bf16 fwd+bwd: flex Triton 2.08 ms, flex FLASH "
        "2.36, SDPA with a bias built once 3.49, a dense bias rebuilt per call 4.82; half precision only: in float32 "
        f"flex is 3-500x slower than SDPA's kernels at head dims >= 128 ({TUNED}). Both ALiBi rows stand ahead of "
        "'chunked prefill' from 2^33 work (2026-12-07): FA4 has no ALiBi, so that row gave large causal chunks to the "
        "plain call with a dense bias. Leave-one-out over the sweep's 762 cases changes 6 far calls' picks: flex "
        "1.17-5.9x faster than the plain call on 4 (0.16-0.84 of the fastest before), 0.81 of it on one forward; on "
        "the sixth flex raised in the sweep (an Inductor compile error, B256 Sq4 Sk65536 D40: there a kernel error "
        "falls back once to the next backend, runtime/dispatch.py); the shipped rule 0.962 / 0.957 -> 0.964 / "
        "0.958, the rows alone 0.918 / 0.894 -> 0.920 / 0.896 "
        "(docs/results/2026-12-07-dev-tune-variants-762-cases-alibi-rows-session26.json). Smaller ALiBi calls stay "
        "where they were ('chunked prefill' from 2^29, else 'small'), and so does ALiBi decode, windowed or not",
        {"alibi": True, "train": True, "varlen": False, "dtype": HALF, "small": False, "decode": False}),
    Row("ALiBi forward", SM90, ("flex",),
        f"{FLEX}: the same call forward back to back: flex Triton 0.49 ms, SDPA with a bias built once 0.92 "
        "(flex FLASH 0.45, but it raises on most masked calls: backends/flex.py); half precision only, as above",
        {"alibi": True, "train": False, "varlen": False, "dtype": HALF, "small": False, "decode": False}),
    Row("chunked prefill and speculative decoding", SM90, ("flash_attn4", "sdpa"),
        f"{BENCH}: 'prefill *' FA4 0.23 vs 0.42 ms, 'spec-decode Sq4' 0.12 vs 0.41 ms; "
        "without FA4 torch's own pick is its native bottom-right flash kernel. Ahead of 'small': SDPA's lower-right "
        "path took 0.41 ms for a call of 2^30 work", {"fewer_queries": True, "work": (FA4_PREFILL_WORK, BIG)}),
    Row("windowed decode", SM90, ("flash_attn4",),
        f"{FLEX}: a windowed decode step (one query, GQA): FA4 0.48 ms, about 2x attnkit's SDPA pick with a "
        "mask; ahead of 'small', where every decode step's work is", {"decode": True, "window": True, "dtype": HALF}),
    Row("small windowed forward", SM90, ("flash_attn4", "sdpa"),
        "the sweep's calls this row takes from 'small' (bench/tune.py, the 762 cases of 2026-12-06: half-precision "
        "windowed forwards below 2^33 work, not decode, ALiBi, packed, or chunked prefill from 2^29): FA4 1.6-15x "
        "faster than the plain call with its mask in the worse timing mode, in all 10 (median 2.3x); without FA4, "
        "the plain call as before. Not training: FA4 lost each of the 7 such fwd+bwd passes (0.57-0.86x). "
        "Leave-one-out over the 762 cases: the rows alone 0.911 / 0.883 -> 0.918 / 0.894, the shipped rule (the "
        "rows decide its far calls) 0.960 / 0.953 -> 0.962 / 0.957; the whole 'sliding window' row moved ahead "
        "instead (training too) put more calls below the plain call, 12.9% against 12.7% "
        "(docs/results/2026-12-06-dev-tune-variants-762-cases-session24.json)",
        {"window": True, "train": False, "alibi": False, "small": True, "dtype": HALF}),
    Row("small", SM90, ("sdpa",),
        f"{BENCH}: 'small *', 'cross fp16 Sq1024 Sk77': the plain call is fastest, FA4 2.5-4x slower (forward "
        "only); since 2026-12-06 the table's tiny points (2^24 work) decide the basic cells' calls down to ~2^22, "
        "where flash's op called directly or FA4 often measured faster (bench/tune.py `tiny`)",
        {"small": True, "dtype": HALF}),
    Row("sliding window", SM90, ("flash_attn4", "flash_attn3", "flash_attn2"),
        f"{BENCH}: 'window *': FA4 1.5 vs 14.3 ms (S16384) and 1.1 vs 6.4 ms fwd+bwd (S4096) against "
        "SDPA with a dense mask", {"window": True}),
    Row("training head_dim <= 96", SM90, ("flash_attn4",),
        f"{BENCH}: 'train D64 S1024 causal', 'train fp16 D64 S2048', 'train D96 S2048 causal': FA4 4-14% faster "
        "fwd+bwd", {"train": True, "head_dim": (1, 96), "dtype": HALF, "work": (FA4_TRAIN_WORK_SMALL_D, BIG)}),
    Row("training head_dim 128", SM90, ("flash_attn4",),
        f"{BENCH}: 'train * D128 S4096..S16384': 5-14%",
        {"train": True, "head_dim": (128, 128), "dtype": HALF, "work": (FA4_TRAIN_WORK_D128, BIG)}),
    Row("long forward head_dim 128", SM90, ("flash_attn4",),
        f"{BENCH}: 'train GQA 32/8 D128 S8192' fwd FA4 1.70 vs 1.81 ms, S16384 3.18 vs 3.58 ms",
        {"train": False, "head_dim": (128, 128), "dtype": HALF, "work": (FA4_INFER_WORK_D128, BIG)}),
    Row("float32", SM90, ("sdpa_efficient", "sdpa"),
        f"{BENCH}: 'train fp32 *': the mem-efficient kernel, with k/v expanded for GQA (torch's own pick falls back "
        "to math there: 0.88 vs 1.43 ms)", {"dtype": "float32"}),
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


def order_for(call: AttentionCall, capability: tuple[int, int] | None) -> tuple[tuple[str, ...], Decision]:
    """The order to try backends in for `call`, and what decided its first entries: the architecture's measured
    table (runtime/table.py) where one exists and has the call's cell, else the first matching hand-written
    row, else the architecture's default order."""
    base = default_order(call, capability)
    if call.device == "cuda" and capability is None:
        return base, Decision("default", "no GPU capability known")
    measured = table.table_for(capability if call.device == "cuda" else None)
    too_far = ""
    if measured is not None:
        d = table.decide(call, measured)
        if d is not None and not d.far:
            return (*d.order, *(n for n in base if n not in d.order)), d
        if d is not None:  # rule 4 decides; the decision says which measured point was too far to
            too_far = f" (the table's nearest point, {d.label}, is far from this call)"
    return rows_order(call, capability, too_far)


def rows_order(call: AttentionCall, capability: tuple[int, int] | None,
               too_far: str = "") -> tuple[tuple[str, ...], Decision]:
    """Rule 4 of runtime/table.py alone: the first matching hand-written row, else the default order."""
    base = default_order(call, capability)
    if call.device != "cuda" or capability is None:
        return base, Decision("default", f"{call.device} order{too_far}")
    f = features(call)
    for row in ROWS:
        if row.matches(f, capability):
            return ((*row.order, *(n for n in base if n not in row.order)),
                    Decision("row", row.label + too_far, row.order))
    return base, Decision("default", f"{table.arch_name(capability)} default order{too_far}")
