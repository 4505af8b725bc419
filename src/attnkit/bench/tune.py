"""`attnkit tune`: the sweep that writes the selection tables (runtime/table.py says how a call is looked up).

- PLAN: a fractional factorial over the call features that change which kernel wins (`FEATURES`): every valid
  categorical cell of runtime/table.py's rule is listed (bfloat16 and float16 as one class, each cell in one of
  them in turn: `_cells`), and the numeric axes (head_dim, total work) are spread over the cells by rotation, so
  each cell gets POINTS_PER_CELL points (BASIC_POINTS for the basic cells, whose first two sit at the common head
  dims) and every head dim and work level is measured in every feature class somewhere. Cases are ordered in
  stages (`plan`: the basic cells first) so that any prefix of a stage is itself balanced (a run cut
  short by the budget has measured a fraction of every class, not all of a few). `--refine REPORT...` adds the
  midpoints between two measured points of one cell whose winners differ: a coarse grid refined where it matters.
- RUN: each case is `bench.run.bench_shape` (the one timer and numerics check of the bench): every backend forced,
  in both timing modes, forward and fwd+bwd, each output checked against the float64 reference; a backend PRUNE
  times slower than the fastest in its first calls is not timed further (it ranks last either way). Shards
  (`--shard I/N`) split the plan; results are appended to a JSON-lines file as each case ends, so a run stopped
  by its budget or a time limit resumes where it was (`--resume`).
- MERGE (`--merge FILE...`): the shards' results become `<arch>.json`: per cell, per point, the correct backends
  fastest first (runtime/table.py, rule 3), with provenance (date, GPU, driver, torch and library versions, the
  grid, the case count). Package data is written by this command only; nobody edits it by hand.
- VALIDATE (`--validate`): shapes that are NOT grid points (odd head dims and sequence lengths, 71 or 20 heads,
  real model configurations): attnkit's choice against the fastest correct candidate, per shape, both modes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from attnkit._io import write_atomic
from attnkit.bench.candidates import AUTO, JIT_WARM_CALLS, PLAIN
from attnkit.bench.run import bench_shape, environment, machine, measuring_device, resumed_rows, same_params
from attnkit.bench.shapes import Shape, mixed_lengths, varlen
from attnkit.errors import UsageError, first_line, out_of_memory
from attnkit.runtime.backends.flex import DECODE_MAX_Q
from attnkit.runtime.call import AttentionCall, normalise_mask
from attnkit.runtime.priority import rows_order
from attnkit.runtime.table import PLAIN as PLAIN_BACKEND
from attnkit.runtime.table import SCHEMA, Rule, log2_seqlen
from attnkit.runtime.table import cell_of as table_cell
from attnkit.runtime.table import decide as table_decide
from attnkit.runtime.table import load as table_load

HEAD_DIMS = (32, 40, 64, 80, 96, 128, 192, 256)
DTYPES = ("bfloat16", "float16", "float32")
KV = {"mha": (16, 16), "gqa4": (32, 8), "gqa8": (32, 4), "mqa": (16, 1)}
QUERY_SHAPES = ("decode", "few", "chunk", "equal", "more")
EXTRAS = ("-", "window", "softcap", "alibi")
VARLEN = ("no", "short", "mixed", "long")
WORK_LOG2 = (27, 31, 35, 39)  # total work from tiny (tens of us) to huge (tens of ms on an H200)
POINTS_PER_CELL = 2
BASIC_POINTS = 6  # points of a basic cell (`basic`): the first two at COMMON_HEAD_DIMS
COMMON_HEAD_DIMS = (128, 64)  # the head dims of most models (Llama, Mistral, Qwen, Gemma-2B/7B: 128; GPT-2, BERT, ViT: 64)
DENSE_WORK_LOG2 = (35, 33, 37, 31, 29)  # `dense`: where training and prefill calls sit (32 heads, D128, batch 1: 2^32 at S1k, 2^38 at S8k)
WIDE_WORK_LOG2 = (35, 33, 37)  # `wide`: the crossover of cuDNN and FA4 in training (2026-12-03 validate)
WIDE = 4  # `wide`: the sequence 4x shorter than shape_for's, the batch 16x larger (the same work)
# `packed`: work levels per length class, within what it reaches (shape_for packs at most 512 sequences; a short
# case's call does ~4x its level's work: its longest sequence, 64, sets the padded length), short first
PACKED_WORK_LOG2 = {"short": (27, 29, 25), "mixed": (31, 35), "long": (35, 37)}
# `alibi_lm`: the work levels per query shape of 1-176B ALiBi models' calls: training and prefill (B1-8, S1k-8k,
# 16-112 heads) at 2^33-2^37; few-query and decode steps at 2^29-2^33 (MPT-7B decoding B64 at Sk8192 is 2^31: a
# decode call's K and V hold 4 bytes per unit of work in MHA, so 2^35 at D128 needs 128 GiB; on 2026-12-07 such
# cases ran the H100's compile shards out of memory)
ALIBI_WORK_LOG2 = {"equal": (35, 33, 37), "chunk": (35, 33, 37), "few": (31, 29, 33), "decode": (31, 29, 33)}
ALIBI_QUERY_SHAPES = tuple(ALIBI_WORK_LOG2)  # training and prefill, chunked prefill, speculative, decode
TINY_WORK_LOG2 = (24,)  # `tiny`: calls of a few us of GPU work (B1 S128 H8 D64 is 2^23), below WORK_LOG2's lowest level
PRUNE = 3.0  # a backend 3x slower than the fastest in its first calls is not timed further (bench_shape's prune)
FEATURES: dict[str, tuple[Any, ...]] = {"head_dim": HEAD_DIMS, "dtype": DTYPES, "causal": (True, False), "kv": tuple(KV),
            "query_shape": QUERY_SHAPES, "extra": EXTRAS, "varlen": VARLEN, "log2_work": WORK_LOG2,
            "pass": ("fwd", "fwdbwd")}
QUICK: dict[str, tuple[Any, ...]] = {"head_dim": (32, 64), "dtype": ("float32",), "causal": (True, False), "kv": ("mha", "gqa4"),
         "query_shape": ("decode", "equal"), "extra": ("-", "alibi"), "varlen": ("no",), "log2_work": (18, 21),
         "pass": ("fwd",)}


def valid(dtype: str, causal: bool, kv: str, qs: str, extra: str, varlen: str) -> bool:
    """Cells a model actually produces (and a kernel can be asked for); dtype may be "half" (_cells)."""
    if varlen != "no" and (qs != "equal" or (extra == "window" and not causal)):
        return False  # packed varlen here is self-attention
    if qs == "more" and causal:
        return False  # causal with more queries than keys leaves rows without keys: not a real model's call
    if dtype == "float32" and (extra in ("window", "softcap") or varlen != "no" or qs in ("few", "chunk")):
        return False  # fp32 attention: small models' training and references: plain calls and ALiBi
    return not (extra == "softcap" and qs in ("decode", "few") and kv == "mqa")


HALF = ("bfloat16", "float16")


def _cells(grid: dict[str, tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The plan's cells. bfloat16 and float16 are one class here: each cell is measured in one of them, in turn,
    and the table's lookup takes a half-precision cell for its sibling (runtime/table.py, rule 1): the kernels
    run both at one tensor-core rate, and measuring both would double a sweep that does not fit one session."""
    half = [d for d in grid["dtype"] if d in HALF]
    classes = (["half"] if half else []) + [d for d in grid["dtype"] if d not in HALF]
    out: list[tuple[Any, ...]] = []
    n_half = 0
    for c in itertools.product(classes, grid["causal"], grid["kv"], grid["query_shape"], grid["extra"],
                               grid["varlen"]):
        if not valid(*c):
            continue
        if c[0] == "half":
            c = (half[n_half % len(half)], *c[1:])
            n_half += 1
        out.append(c)
    return out


def shape_for(cell: tuple[Any, ...], head_dim: int, log2w: float, train: bool, seed: int) -> Shape:
    """A concrete call of `cell` at (head_dim, about 2**log2w work)."""
    dtype, causal, kv, qs, extra, varlen = cell
    heads, kv_heads = KV[kv]
    per = heads * head_dim
    budget = 2.0 ** log2w / per  # batch * seqlen_q * seqlen_k
    window = None
    lengths = None
    if varlen != "no":
        lo, hi = {"short": (1, 64), "mixed": (17, 2048), "long": (2048, 8192)}[varlen]
        mean_sq = ((lo + hi) / 2) ** 2
        n = max(2, min(512, round(budget / mean_sq)))
        rng = random.Random(seed)
        lengths = tuple([hi, *(rng.randint(lo, hi) for _ in range(n - 1))])
        s = max(lengths)
        batch, sq, sk = n, s, s
    elif qs in ("decode", "few"):
        sq = 1 if qs == "decode" else 4
        sk = int(min(65536, max(256, 2 ** round(math.log2(max(1.0, budget / (16 * sq)))))))
        batch = max(1, min(256, round(budget / (sq * sk))))
    elif qs == "chunk":
        sk = int(min(32768, max(512, 2 ** round(math.log2(math.sqrt(max(1.0, budget * 8)))))))
        sq = sk // 8
        batch = max(1, min(256, round(budget / (sq * sk))))
    elif qs == "more":
        sk = int(min(8192, max(64, 2 ** round(math.log2(math.sqrt(max(1.0, budget / 4)))))))
        sq = 4 * sk
        batch = max(1, min(256, round(budget / (sq * sk))))
    else:
        s = int(min(16384, max(64, 2 ** round(math.log2(math.sqrt(max(1.0, budget)))))))
        sq = sk = s
        batch = max(1, min(256, round(budget / (s * s))))
    if extra == "window":
        window = (max(16, sk // 8), 0) if causal else (max(16, sk // 16), max(16, sk // 16))
    label = "|".join(map(str, (*cell, f"D{head_dim}", f"w{log2w:g}", "train" if train else "fwd")))
    return Shape(label, batch, heads, kv_heads, sq, sk, head_dim, dtype, causal, window, lengths,
                 train=train, alibi=extra == "alibi", softcap=30.0 if extra == "softcap" else 0.0)


def basic(cell: tuple[Any, ...]) -> bool:
    """A cell without window, softcap, ALiBi or packing: the calls most models make (plain causal or full
    attention in every query shape and kv sharing), given BASIC_POINTS points, measured first."""
    return cell[4] == "-" and cell[5] == "no"


def dense(cells: list[tuple[Any, ...]], order: list[int], train_ok: bool) -> list[Shape]:
    """The basic half-precision cells at COMMON_HEAD_DIMS on a lattice 4x apart in work (DENSE_WORK_LOG2) where
    the grid steps 16x: the lookup's "near" reaches 4x (runtime/table.py), so between two grid levels a winner
    that changes was decided by a point up to 8x off, or by another cell's. On 2026-12-02 (validate, 263 cases)
    MQA training at S2048 D64, where FA4 is 1.18x faster, was decided by SDPA's point of the GQA cell at 2^35:
    MQA's own points sat at 2^31 (SDPA) and 2^39 (FA4). float32 is left out: it trains small models only.
    Ordered level by level (the middle of real models' range first), each level's cells in `order`."""
    out = []
    for lw in DENSE_WORK_LOG2:
        for hd in COMMON_HEAD_DIMS:
            for i in order:
                c = cells[i]
                if basic(c) and c[0] in HALF:
                    out.append(shape_for(c, hd, float(lw), train_ok and c[3] not in ("decode", "few"), seed=i))
    return out


def wide(cells: list[tuple[Any, ...]], order: list[int], train_ok: bool) -> list[Shape]:
    """The basic half-precision cells with equal lengths at COMMON_HEAD_DIMS again, each at the same work with a
    sequence WIDE times shorter and a batch WIDE**2 times larger, labelled `<case>|wide`. shape_for reaches a work
    level with the longest sequence and batch 1-2 (batch x heads 16-64), where real training and prefill run
    batch x heads 64-512 at shorter sequences. On 2026-12-03 the validate shapes' fwd+bwd at the cuDNN/FA4
    crossover (2^33-2^36) lost up to 17% to such points: Falcon-7B's B4 x 71 heads at S2048 runs faster on FA4
    where the grid's B2 x 16 heads at S4096 ran faster on cuDNN. A wide case has its long twin's cell, head dim and
    work; since 2026-12-06 `merge` keeps the two apart by sequence length (Rule.far_seqlen_log2), where it had
    averaged them into one point."""
    out = []
    for lw in WIDE_WORK_LOG2:
        for hd in COMMON_HEAD_DIMS:
            for i in order:
                c = cells[i]
                if basic(c) and c[0] in HALF and c[3] == "equal":
                    s = shape_for(c, hd, float(lw), train_ok, seed=i)
                    if s.seqlen_q >= 256 * WIDE:
                        sq = s.seqlen_q // WIDE
                        out.append(replace(s, label=f"{s.label}|wide", batch=s.batch * WIDE * WIDE, seqlen_q=sq,
                                           seqlen_k=sq))
    return out


def packed(cells: list[tuple[Any, ...]], order: list[int], train_ok: bool) -> list[Shape]:
    """The plain packed-varlen cells (no window, softcap or ALiBi) in half precision at COMMON_HEAD_DIMS, at each
    length class's PACKED_WORK_LOG2 levels, class by class (short sequences first) and level by level, training
    where the grid trains. Packed training batches and packed encoders are common calls, and the plan reached
    these cells only among "every other cell", one or two points each at the work a length class barely reaches.
    On 2026-12-04 the held-out packed encoder (64 sequences of 24-200) and 400 very short sequences at D32 found
    no near point in their cells and got 0.43-0.79 of the fastest: short sequences go first, since no other
    stage measures them near the work such batches do."""
    out = []
    for cls, levels in PACKED_WORK_LOG2.items():
        for lw in levels:
            for hd in COMMON_HEAD_DIMS:
                out += [shape_for(cells[i], hd, float(lw), train_ok, seed=i) for i in order
                        if cells[i][0] in HALF and cells[i][4] == "-" and cells[i][5] == cls]
    return out


def tiny(cells: list[tuple[Any, ...]], order: list[int], train_ok: bool) -> list[Shape]:
    """The basic half-precision cells at COMMON_HEAD_DIMS at TINY_WORK_LOG2, training where the grid trains: calls
    whose kernels take a few us, so each route's host time decides (the plain call's, a kernel's op called
    directly, the cuDNN gradient-layout hook's in a backward). The grid's lowest level is 2^27 and "near" reaches
    4x (runtime/table.py), so below ~2^25 no point decided and the hand-written 'small' row did: torch's own pick,
    read off a forward-only bench. On 2026-12-06 (H100) a B1 S128 H8 D64 training call (2^23) ran 0.83-0.91 of
    the plain call's speed there, where flash's op called directly ran 0.95-1.08.
    A cell whose smallest call at a head dim (shape_for's floors: a chunk of 64 queries against 512 keys, a sequence
    of 64 keys; more kv heads and a larger head dim do more work) does more than twice a level's work is left out
    at that head dim: the grid's own levels reach it (14 of the 72: chunked prefill, GQA with more queries)."""
    out = []
    for lw, hd, i in itertools.product(TINY_WORK_LOG2, COMMON_HEAD_DIMS, order):
        if basic(cells[i]) and cells[i][0] in HALF:
            s = shape_for(cells[i], hd, float(lw), train_ok and cells[i][3] not in ("decode", "few"), seed=i)
            if _call_of(asdict(s), False).work <= 2.0 ** (lw + 1):  # the runtime's own work (AttentionCall.work)
                out.append(s)
    return out


def alibi_lm(cells: list[tuple[Any, ...]], order: list[int], train_ok: bool) -> list[Shape]:
    """The cells ALiBi language models call (causal, MHA, half precision, unpacked: BLOOM, MPT, Falcon-RW,
    Baichuan-13B) at COMMON_HEAD_DIMS, in every query shape they run, on that shape's ALIBI_WORK_LOG2 levels,
    training where the query shape trains; level by level (each shape's middle level first). The grid gives a cell with a feature
    two points at a rotating head dim, so until 2026-12-07 the causal MHA ALiBi cell with equal lengths had no point
    at all, and ALiBi calls at D128 were decided by D192 or D40 points, or by another kv sharing's: on the bench's
    MHA D128 chunk (Sq1024 Sk8192) that was flex, 0.69-0.91 of the plain call (H100, session 28)."""
    out = []
    levels = max(len(v) for v in ALIBI_WORK_LOG2.values())
    for level, hd, i in itertools.product(range(levels), COMMON_HEAD_DIMS, order):
        c = cells[i]
        if (c[0] in HALF and c[1] is True and c[2] == "mha" and c[4:] == ("alibi", "no")
                and level < len(ALIBI_WORK_LOG2.get(c[3], ()))):
            lw = ALIBI_WORK_LOG2[c[3]][level]
            out.append(shape_for(c, hd, float(lw), train_ok and c[3] not in ("decode", "few"), seed=i))
    return out


def plan(grid: dict[str, tuple[Any, ...]] | None = None, points: int | None = None) -> list[Shape]:
    """The fractional design, in stages whose every prefix is balanced over the stage's cells: the basic cells'
    first two points (head dims COMMON_HEAD_DIMS, the ones most models use), then those cells in half precision
    at the common head dims on a finer lattice in work (`dense`), then the plain packed cells (`packed`), then the
    basic cells with equal lengths again at a shorter sequence and a larger batch (`wide`), then the basic
    half-precision cells at a few us of work (`tiny`), then every other cell's first point, then the rest, then
    the cells ALiBi language models call, on a lattice (`alibi_lm`). A session's timed budget measures 100-200
    cases (191 in 380 s on 2026-12-03): the first ones measure the calls most models make, at their head dims,
    before the features few of them use."""
    grid = grid or FEATURES
    quick = grid is QUICK
    cells = _cells(grid)
    dims, works = grid["head_dim"], grid["log2_work"]
    rest_dims = [d for d in dims if d not in COMMON_HEAD_DIMS] or list(dims)
    train_ok = "fwdbwd" in grid["pass"]
    per_cell: list[list[Shape]] = []
    for ci, cell in enumerate(cells):
        qs, is_basic = cell[3], basic(cell) and not quick
        n = points or (1 if quick else BASIC_POINTS if is_basic else POINTS_PER_CELL)
        shapes = []
        for k in range(n):
            # rotation: cell ci's k-th point takes head dim (ci + k * stride) and work level (ci // len + k)
            if is_basic:
                hd = COMMON_HEAD_DIMS[k] if k < len(COMMON_HEAD_DIMS) else rest_dims[(ci * 3 + k) % len(rest_dims)]
            else:
                hd = dims[(ci * 3 + k * 5) % len(dims)]
            lw = works[(ci + k * (len(works) // 2 or 1) + ci // len(dims)) % len(works)]
            # a training case measures both passes: every basic point trains where its query shape does
            train = train_ok and qs not in ("decode", "few") and (is_basic or k % 2 == 0 or "fwd" not in grid["pass"])
            shapes.append(shape_for(cell, int(hd), float(lw), train, seed=ci * 7 + k))
        per_cell.append(shapes)
    order = list(range(len(cells)))
    random.Random(0).shuffle(order)  # any prefix of a stage: a random fraction of its cells
    out: list[Shape] = []
    most = max(len(x) for x in per_cell) if per_cell else 0
    stages = [(True, 0), (True, 1), (False, 0)] + [(b, k) for k in range(1, most) for b in (True, False)
                                                   if (b, k) != (True, 1)]
    for want_basic, k in stages:
        out += [per_cell[i][k] for i in order if k < len(per_cell[i]) and basic(cells[i]) == want_basic]
        if (want_basic, k) == (True, 1) and not quick and points is None:
            out += (dense(cells, order, train_ok) + packed(cells, order, train_ok) + wide(cells, order, train_ok)
                    + tiny(cells, order, train_ok))
    if not quick and points is None:
        out += alibi_lm(cells, order, train_ok)
    first: dict[str, Shape] = {}
    for s in out:  # a lattice point the grid has already: measured once, where it first comes
        first.setdefault(s.label, s)
    return list(first.values())


def matching(cases: list[Shape], match: str | None) -> list[Shape]:
    """The plan's cases whose label `match` finds (re.search), in plan order: one stage or cell measured ahead of
    the plan's order (`--match '\\|short\\|'`: the short packed cells) without a plan of its own."""
    return cases if match is None else [s for s in cases if re.search(match, s.label)]


def planned(grid: dict[str, tuple[Any, ...]], match: str | None) -> list[Shape]:
    """The plan of the grid this run measures, narrowed by --match; a --match that finds none of it is refused
    here, where the grid is known (a machine without a GPU runs the quick grid, whatever the command line says)."""
    cases = matching(plan(grid), match)
    if match is not None and not cases:
        which = "quick grid (--quick, or a machine without a GPU)" if grid is QUICK else "full grid"
        raise UsageError(f"--match: {match!r} finds no case of the {which}; see `attnkit tune --plan"
                         f"{' --quick' if grid is QUICK else ''} --match ...`")
    return cases


def refreshed(files: list[Path], kind: str, match: str | None) -> list[Shape]:
    """The cases `--refresh-KIND` times again, narrowed by --match: a refresh that a session's budget cannot finish
    (2026-12-07: 98 flex cases, and 614 s of device time left after ten refused starts) takes the cells asked for
    first, in refresh order. A --match that finds none of them is refused, as for the plan (a refresh that picks
    no case runs none, with or without one)."""
    cases = _parsed(f"--refresh-{kind}", files, lambda: refresh_cases(files, kind))
    found = matching(cases, match)
    if match is not None and cases and not found:
        raise UsageError(f"--match: {match!r} finds none of the {len(cases)} cases --refresh-{kind} picks from "
                         f"{', '.join(map(str, files))[:200]}")
    return found


def refine(results: list[dict[str, Any]], grid: dict[str, tuple[Any, ...]] | None = None) -> list[Shape]:
    """Midpoints where a cell's winner changes between two measured points of one head dim (in log2 work)."""
    by_cell: dict[tuple[Any, ...], list[tuple[float, str, dict[str, Any]]]] = {}
    for r in results:
        if r["shape"]["label"].endswith("|wide"):  # the long lattice's levels decide; a wide twin sits on one of them
            continue
        parts = tuple(r["shape"]["label"].split("|")[:6])
        for ps in r.get("cell", {}):
            order = decision_order(r, ps)
            if order:
                by_cell.setdefault((parts, ps, r["head_dim"]), []).append((r["log2_work"], order[0], r))
    extra: list[Shape] = []
    seen = {r["shape"]["label"] for r in results}
    for (parts, _, hd), pts in by_cell.items():
        pts.sort(key=lambda t: t[0])
        for (w1, b1, r1), (w2, b2, _) in itertools.pairwise(pts):
            if b1 != b2 and w2 - w1 > 1.0:
                cell = (parts[0], parts[1] == "True", *parts[2:])
                s = shape_for(cell, hd, round((w1 + w2) / 2, 1), r1["shape"]["train"], seed=int(w1 * 10))
                if s.label not in seen:
                    seen.add(s.label)
                    extra.append(s)
    return extra


def chart(table: dict[str, Any], path: Path) -> None:
    """One PNG: per cell (a row), each measured point at its log2(work), labelled with its winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(table["cells"])
    winners = sorted({p["order"][0] for pts in table["cells"].values() for p in pts})
    colour = {w: plt.get_cmap("tab20")(i % 20) for i, w in enumerate(winners)}
    fig, ax = plt.subplots(figsize=(12, max(4, 0.22 * len(cells))))
    for y, cell in enumerate(cells):
        for pt in table["cells"][cell]:
            ax.scatter(pt["log2_work"], y, color=colour[pt["order"][0]], s=12 + pt["head_dim"] / 4)
    ax.set_yticks(range(len(cells)))
    ax.set_yticklabels(cells, fontsize=6)
    ax.set_xlabel("log2(batch * heads * seqlen_q * seqlen_k * head_dim); marker size: head_dim")
    for w in winners:
        ax.scatter([], [], color=colour[w], label=w)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    prov = table["provenance"]
    ax.set_title(f"winner per measured point: {table['arch']}, {', '.join(prov['gpus']) or 'CPU'}, torch "
                 f"{prov['torch']}, {prov['date'][:10]}", fontsize=9)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


# -- one case's decision ------------------------------------------------------------------------------------------

def scores(result: dict[str, Any], ps: str) -> dict[str, float]:
    """Per backend forced in this case and correct there: its worst ratio to the fastest over the two timing
    modes (1.0 = fastest in both)."""
    t = _times(result, ps)
    if not t:
        return {}
    best = {m: min(v[m] for v in t.values()) for m in ("sync", "b2b")}
    return {n: max(v[m] / best[m] for m in ("sync", "b2b")) for n, v in t.items()}


def _positive(x: Any) -> bool:
    """A time that can rank: a finite number > 0 (a file edited by hand may hold 0, NaN or a string)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def ranked(score: dict[str, float]) -> list[str]:
    return sorted(score, key=lambda n: (score[n], n))


def decision_order(result: dict[str, Any], ps: str) -> list[str]:
    """Rule 3 of runtime/table.py for one case: the correct backends, fastest first by `scores`."""
    return ranked(scores(result, ps))


# -- run, resume, merge --------------------------------------------------------------------------------------------

REFRESHED_BY = "flash_attn4"  # the backend whose host path changed (runtime/backends/fa4_replay.py, fa4_ops.py)
REFRESH_KINDS = ("fwd", "train", "varlen", "flex")
# flex: each size of a signature compiled for itself from this time on (runtime/backends/flex.py `entry_point`,
# `for_measurement`); before, every case after a signature's first in a process timed flex's dynamic graph, 1.3-1.8x
# slower with ALiBi (docs/results/2026-12-07-h100-flex-first-size-session30.json), so those cases undervalue flex
FLEX_STATIC_SINCE = "2026-12-07T17:00"
REFRESH_FLEX_NEAR = 1.9  # ... a contender: its compiled-for-its-size kernel can make up that much
# varlen: torch_varlen calls aten's varlen FlashAttention pair directly since this date (runtime/backends/
# torch_varlen.py: its custom-op host path took 0.8 ms per packed fwd+bwd step); packed cases timed before it are stale
TORCH_VARLEN_DIRECT_SINCE = "2026-12-05T16:00"
REFRESH_TRAIN_WORK = (31.0, 37.0)  # `train` refresh: where cuDNN and FA4 cross in fwd+bwd (2026-12-03 validate)
REFRESH_TRAIN_NEAR = 1.5  # ... and FA4 a contender there: within 1.5x of the fastest fwd+bwd (scores)
# FA4's training path replayed (fa4_ops.eager_function) from this session on: lines under a header dated before it
# timed FA4's own autograd.Function, its forward and backward host paths on every step
FA4_TRAIN_SINCE = "2026-12-03T19:20"


def _parsed(flag: str, files: list[Path], read: Any) -> Any:
    """`read()` over result files that may have been edited or cut: a line of the wrong shape is one line naming
    the option and the files, as --merge says it, not a traceback."""
    try:
        return read()
    except UsageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, RecursionError) as exc:
        raise UsageError(f"{flag}: a line of {', '.join(map(str, files))[:200]} is not what `attnkit tune` writes "
                         f"({type(exc).__name__}: {first_line(exc, 80)})") from None


def refresh_cases(files: list[Path], kind: str = "fwd") -> list[Shape]:
    """Recorded cases to time again under their own labels, because FlashAttention-4's host path changed; a later
    line's passes replace an earlier's in --merge (`latest_passes`), so what is not timed again stays.
    - fwd: the cases whose forward FA4 ran, forward only: its forward replay (fa4_replay) took ~50-60 us of host
      time off each call on the H200 (2026-12-02).
    - train: the basic half-precision training cases at REFRESH_TRAIN_WORK whose fwd+bwd FA4 ran within
      REFRESH_TRAIN_NEAR of the fastest, both passes: FA4's training path now replays its forward too
      (fa4_ops.eager_function; before, autograd calls ran FA4's whole forward host path), and those are the
      points where cuDNN and FA4 trade places. A case already timed on that path (a line under a header dated
      FA4_TRAIN_SINCE or later) is not timed again.
    - varlen: the packed cases torch_varlen ran, every pass they have, timed before TORCH_VARLEN_DIRECT_SINCE
      (torch_varlen's host path changed: those packed cases' scores undervalue it).
    - flex: the cases of one length and at least DECODE_MAX_Q queries (packed calls and decode keep the dynamic
      kernel) timed before FLEX_STATIC_SINCE where flex was within REFRESH_FLEX_NEAR of the fastest in a pass,
      every pass they have; score mods first (ALiBi gained most; softcap, unmeasured, likewise a score mod), then
      windows, then masks alone, each nearest contender first."""
    if kind not in REFRESH_KINDS:
        raise ValueError(f"refresh kind {kind!r}: one of {', '.join(REFRESH_KINDS)}")
    out: dict[str, Shape] = {}
    lo, hi = REFRESH_TRAIN_WORK
    lines = [r for f in files for r in _read_lines(f)]
    current = set()  # train: cases already timed on FA4's replayed training path (FA4_TRAIN_SINCE)
    static: dict[str, set[str]] = {}  # flex: passes already timed with flex compiled for their size
    rank: dict[str, tuple[int, float]] = {}
    direct = set()  # varlen: cases already timed on torch_varlen's direct route (TORCH_VARLEN_DIRECT_SINCE)
    date = ""
    for r in lines:
        if r.get("header"):
            date = str((r.get("environment") or {}).get("date", ""))
        elif "shape" in r and date >= TORCH_VARLEN_DIRECT_SINCE:
            timed = set(r.get("ms", {}).get("attnkit:torch_varlen", {}))  # a forward-only line is no fwd+bwd
            if {"fwd", "fwdbwd"} <= timed or ("fwd" in timed and not r["shape"].get("train")):
                direct.add(r["shape"]["label"])
        if "shape" in r and date >= FLEX_STATIC_SINCE:  # the passes that timed flex since (a forward refresh
            static.setdefault(r["shape"]["label"], set()).update(r.get("ms", {}).get("attnkit:flex", {}))  # alone
            # leaves a training case's fwd+bwd stale)
        if ("shape" in r and date >= FA4_TRAIN_SINCE and "fwdbwd" in r.get("cell", {})  # a forward-only
                and not unsteady_pruned(r, "fwdbwd", date)):  # refresh is not one, nor an unsteady fwd+bwd
            current.add(r["shape"]["label"])
    for r in latest_passes([r for f in files for r in steady_cases(_read_lines(f))]):
        d = dict(r["shape"])
        if kind == "fwd":
            if "fwd" not in r.get("ms", {}).get(f"attnkit:{REFRESHED_BY}", {}):
                continue
            d["train"] = False
        elif kind == "varlen":
            if not (d.get("lengths") and r.get("ms", {}).get("attnkit:torch_varlen")) or d["label"] in direct:
                continue
        elif kind == "flex":
            near = min((scores(r, ps).get("flex", float("inf")) for ps in ("fwd", "fwdbwd")), default=float("inf"))
            if (d.get("lengths") or d.get("seqlen_q", 0) < DECODE_MAX_Q or near > REFRESH_FLEX_NEAR
                    or set(r["ms"].get("attnkit:flex", {})) <= static.get(d["label"], set())):
                continue
            rank[d["label"]] = (0 if d.get("alibi") or d.get("softcap") else 1 if d.get("window") else 2, near)
        else:
            fa4 = scores(r, "fwdbwd").get(REFRESHED_BY)
            plain = not (d.get("window") or d.get("lengths") or d.get("alibi") or d.get("softcap"))
            if not (fa4 is not None and fa4 <= REFRESH_TRAIN_NEAR and plain and d.get("dtype") in HALF
                    and lo <= r.get("log2_work", 0) <= hi and d["label"] not in current):
                continue
        for k in ("window", "lengths", "lengths_k"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        out[d["label"]] = Shape(**d)
    if kind == "flex":
        return sorted(out.values(), key=lambda sh: rank[sh.label])
    return list(out.values())


def latest_passes(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per case label: where a label comes again (a forward refresh), its passes replace the earlier
    record's, every candidate's times for that pass with them (a refreshed pass never mixes two sessions)."""
    merged: dict[str, dict[str, Any]] = {}
    for r in results:
        label = r["shape"]["label"]
        base = merged.get(label)
        if base is None:
            merged[label] = r
            continue
        base = merged[label] = json.loads(json.dumps(base))  # the first record stays as it was read
        for ps, cell in r.get("cell", {}).items():
            base.setdefault("cell", {})[ps] = cell
            if "_gpus" in r:  # the GPU of the pass that stands (tune --merge's tag)
                base.setdefault("_gpus", {})[ps] = r["_gpus"][ps]
            for v in base.get("ms", {}).values():
                v.pop(ps, None)
            for n, v in r.get("ms", {}).items():
                if ps in v:
                    base.setdefault("ms", {}).setdefault(n, {})[ps] = v[ps]
        base["wrong"] = {**base.get("wrong", {}), **r.get("wrong", {})}
    return list(merged.values())


def _append_line(path: Path, row: dict[str, Any]) -> None:
    """One JSON line at the end of `path`; a last line cut by a kill is ended first, so this one stays whole."""
    with path.open("a+b") as f:
        cut = False
        if f.seek(0, 2) > 0:
            f.seek(-1, 2)
            cut = f.read(1) != b"\n"
        f.write((("\n" if cut else "") + json.dumps(row, default=str) + "\n").encode("utf-8"))


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read as attnkit tune lines ({type(exc).__name__})") from None
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a kill: that case runs again
        if isinstance(row, dict):
            out.append(row)
    return out


def run(out: Path, shard: tuple[int, int] = (1, 1), budget_s: float = 1500.0, quick: bool = False,
        refine_from: list[Path] | None = None, max_cases: int | None = None, say: Any = print,
        only_compiled: bool = False, refresh: list[Path] | None = None, refresh_kind: str = "fwd",
        match: str | None = None) -> dict[str, Any]:
    """Measure this shard's cases not yet in `out` (JSON lines: a header line, then one line per case).
    `refresh`: instead of the plan, those files' cases that `refresh_cases` picks for `refresh_kind` (and `match`
    finds, when given).
    `only_compiled`: just the cases the compile phase finished (compiled_path), so no JIT compile lands in the
    timed budget; the rest wait for a later session's compile phase (--resume). `match`: the plan's cases whose
    label it finds (`matching`)."""
    from attnkit.bench.timer import warm_gpu
    device = measuring_device("tune")
    grid = QUICK if (quick or device == "cpu") else FEATURES
    if refresh:
        cases = refreshed(refresh, refresh_kind, match)
    elif refine_from:
        prior = [r for f in refine_from for r in _read_lines(f) if "shape" in r]
        cases = _parsed("--refine", refine_from, lambda: refine(prior, grid))
    else:
        cases = planned(grid, match)
    i, n = shard
    mine = cases[i - 1::n]
    done_lines = _sweep_lines(out, "--out", "; choose a new file")  # else a header would replace it
    done = _parsed("--out", [out], lambda: done_labels(done_lines))
    header = {"header": True, "schema": SCHEMA, "environment": environment(), "device": device,
              "grid": {k: list(v) for k, v in grid.items()}, "shard": f"{i}/{n}", "planned": len(mine),
              "refine": [str(f) for f in refine_from or []], "refresh": [str(f) for f in refresh or []],
              **({"match": match} if match is not None else {}),
              **({"refresh_kind": refresh_kind} if refresh else {})}
    if not done_lines:
        write_atomic(out, json.dumps(header, default=str) + "\n")
    todo = [s for s in mine if s.label not in done]
    warm_labels = compiled_labels(out)
    if warm_labels:  # what the compile shards finished first: the timed budget goes to timing, not to JIT compiles
        todo = [s for s in todo if s.label in warm_labels] + [s for s in todo if s.label not in warm_labels]
    waiting = 0
    if only_compiled:
        waiting = sum(s.label not in warm_labels for s in todo)
        todo = [s for s in todo if s.label in warm_labels]
    if max_cases is not None:
        todo = todo[:max_cases]
    if done_lines and todo:  # a resumed run heads its own cases with its session's date and machine
        _append_line(out, header)
    if device == "cuda" and todo:
        warm_gpu()
    t0 = time.perf_counter()
    ran = 0
    unfit: list[str] = []
    for s in todo:
        if time.perf_counter() - t0 > budget_s:
            say(f"tune: budget of {budget_s:.0f} s reached; {len(todo) - ran - len(unfit)} cases left (run again "
                "with --resume)")
            break
        r = None
        for attempt in (1, 2):
            failed = ""
            c0 = time.perf_counter()
            try:
                r = bench_shape(s, device, iters=3 if grid is QUICK else 8, rounds=2 if grid is QUICK else 3,
                                backends_only=True, prune=PRUNE)
            except Exception as exc:  # the case's own tensors did not fit (a candidate's OOM is its recorded error)
                if not out_of_memory(exc):
                    raise
                failed = f"{type(exc).__name__}: {first_line(exc, 120)}"
            if r is not None:
                break
            _release_memory(device)  # outside the except: its traceback holds the frames that hold the tensors
            if attempt == 2:  # no line: a --resume on a device with more free memory takes it
                unfit.append(s.label)
                say(f"tune {s.label}: does not fit this device, twice ({failed}); left out")
        if r is None:
            continue
        r["seconds"] = round(time.perf_counter() - c0, 2)
        _append_line(out, r)  # one line per case: a kill loses at most the case running
        ran += 1
        say(f"tune {s.label}: {r['seconds']:.1f} s, fastest {decision_order(r, 'fwd')[:1]}")
    return {"planned": len(mine), "done_before": len(done), "ran": ran, "left": len(todo) - ran - len(unfit) + waiting,
            "not_compiled": waiting, "did_not_fit": unfit}


def _release_memory(device: str) -> None:
    """What a case that ran out of memory may find held before its retry: attnkit's bound calls (each keeps its
    call's ALiBi slopes, and so their dense bias in layout.BIASES), the dense biases and masks themselves, and
    the allocator's free blocks. On 2026-12-07 (H100) a case that one run had timed found 74 GiB held by the next."""
    import gc

    from attnkit.runtime import dispatch, layout

    dispatch.invalidate(None)
    layout.BIASES.clear()
    layout.cached_mask.cache_clear()
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


COMPILE_LOCK = "attnkit-tune-compile.lock"  # beside the shards' common --out, else in the temp folder


@contextlib.contextmanager
def _gpu_share(exclusive: bool, beside: Path | None) -> Iterator[None]:
    """The compile shards' hold on the GPU's memory (fcntl.flock on one file, released if a shard dies): shared
    through a shard's first pass over its cases, exclusive for each retry of a case that ran out of memory, so a
    retry runs once no shard is in its first pass and no other retry runs beside it. The file is beside the --out
    the shards resume (`beside`), where they write anyway; without one, in the temp folder."""
    import fcntl
    import tempfile

    lock = beside.with_name(f"{beside.name}.{COMPILE_LOCK}") if beside else Path(tempfile.gettempdir()) / COMPILE_LOCK
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compiled_path(out: Path) -> Path:
    """Beside the timed run's --out: the labels whose kernels compile-only has compiled, one per line."""
    return out.with_name(out.name + ".compiled")


def compiled_labels(out: Path) -> set[str]:
    try:
        return set(compiled_path(out).read_text(encoding="utf-8", errors="replace").split("\n")) - {""}
    except OSError:
        return set()


def compile_only(shard: tuple[int, int] = (1, 1), quick: bool = False, max_cases: int | None = None,
                 say: Any = print, skip_done: Path | None = None,
                 refresh: list[Path] | None = None, refresh_kind: str = "fwd",
                 match: str | None = None) -> dict[str, Any]:
    """Run the held-out shapes, then every case of this shard's plan (with `match`, the cases it finds first, then
    the held-out shapes), once per pass and backend that compiles
    (`Backend.compiles`), untimed: the JIT compiles (FlashAttention-4, flex) land in their disk caches. JIT compiling is CPU work: shards of this run side by side on one GPU machine
    while the timed run, which must have the GPU alone, comes after and finds every kernel compiled.
    `skip_done`: the timed run's --out being resumed; its cases are not compiled again, and each case compiled
    here is listed beside it (compiled_path), so the timed run measures those first: on 2026-12-01 a case whose
    flex kernels the compile shards had not reached took 320 s of a 200 s timed budget."""
    import torch

    from attnkit.runtime.backends.flex import for_measurement
    for_measurement()
    device = measuring_device("tune --compile-only")
    grid = QUICK if (quick or device == "cpu") else FEATURES
    i, n = shard
    done = _parsed("--out", [skip_done], lambda: done_labels(_read_lines(skip_done))) if skip_done else set()
    # the held-out shapes first (validate times every candidate there, the libraries' own calls too: on
    # 2026-12-01 it ran 5 of 11 shapes in 150 s, compiling), then the plan's cases not yet measured; with --match
    # the cases asked for come first (2026-12-06: a 200 s phase spent on the 14 held-out shapes left 14 of the 58
    # matched cases uncompiled, so the timed run skipped them)
    held_out = [] if refresh else validation_shapes(grid is QUICK)
    todo = refreshed(refresh, refresh_kind, match) if refresh else planned(grid, match)
    todo = [s for s in todo if s.label not in done]
    cases = ([*todo, *held_out] if match else [*held_out, *todo])[i - 1::n][:max_cases]
    failed, left = 0, 0
    deferred: list[Shape] = []

    def attempt(s: Shape, last: bool) -> None:
        nonlocal failed, left
        try:  # a candidate that raises is the timed run's to record: the case is listed
            errors = _compile_case(s, device, every_candidate=s in held_out)
            failed += errors
            say(f"compiled {s.label}" + (f" ({errors} candidate errors: the timed run records them)" if errors else ""))
            # one short line per append: shards do not interleave in it
            if skip_done is not None and s not in held_out:
                with compiled_path(skip_done).open("a", encoding="utf-8") as f:
                    f.write(s.label + "\n")
        except Exception as exc:  # the case itself could not be held (its tensors): not listed
            if not last and out_of_memory(exc):
                deferred.append(s)
                say(f"deferred {s.label}: {first_line(exc, 120)}")
            else:
                left += 1
                say(f"left for the timed run {s.label}: {type(exc).__name__}: {first_line(exc, 160)}")
        if device == "cuda":  # the case's tensors (held by _compile_case's frame only) are gone: give them back
            torch.cuda.empty_cache()

    with _gpu_share(exclusive=False, beside=skip_done):
        for s in cases:
            attempt(s, last=False)
    # 16 shards share the GPU's memory: on 2026-12-03 153 of ~260 cases (the largest, 2^35-2^39 in work) ran out of
    # it beside the other shards' tensors, and the timed run skipped them uncompiled. Each is tried again once this
    # shard and every other has finished its first pass, one retry at a time across the shards
    for s in deferred:
        with _gpu_share(exclusive=True, beside=skip_done):
            attempt(s, last=True)
    return {"cases": len(cases), "candidate_errors": failed, "deferred": len(deferred), "left_for_timed_run": left}


def _compile_case(s: Shape, device: str, every_candidate: bool = False) -> int:
    """One case's candidates that compile, run once (forward, and fwd+bwd for training); the number of candidate
    errors. `every_candidate`: the libraries' own calls too (a held-out shape of --validate)."""
    import torch

    from attnkit.bench.candidates import Case, compiles
    from attnkit.bench.timer import warm

    c = Case(s, device)
    failed = 0
    for grad in ((False, True) if s.train else (False,)):
        runs, _ = c.candidates(grad, backends_only=not every_candidate)
        # only the backends with something to compile: on 2026-12-01 16 shards running every backend (sdpa_math's
        # score matrix at the largest work levels) ran out of GPU memory on 7 of 16 and compiled 54 cases in 120 s
        runs = {n: fn for n, fn in runs.items() if compiles(n)}
        if grad:
            runs = {name: c.step(fn, name) for name, fn in runs.items()}
        with torch.set_grad_enabled(grad):
            _, errors = warm(runs, device, times=1)
        oom = next((f"{n}: {e}" for n, e in errors.items() if out_of_memory(e)), None)
        if oom is not None:  # not the candidate's own error: the case did not fit beside the other shards'
            raise MemoryError(oom)
        failed += len(errors)
    return failed


def merge(files: list[Path], arch: str | None = None, flag: str = "--merge") -> dict[str, Any]:
    """The selection table from shard files (runtime/table.py's format), with provenance. `flag`: the option
    the files came in by, which the one-line errors name. The table is checked as the runtime loads it, so a
    table written is one the runtime takes."""
    from attnkit.runtime.table import TableError
    from attnkit.runtime.table import validate as validate_table
    try:
        table = _parsed(flag, files, lambda: _merge(files, arch))
        if not table["cells"]:
            raise UsageError(f"--merge: {', '.join(map(str, files))[:200]}: no case with a timed pass (nothing to "
                             "decide from)")
        return validate_table(table, "the merged table")
    except UsageError as exc:
        raise UsageError(str(exc).replace("--merge:", f"{flag}:", 1)) from None
    except TableError as exc:
        raise UsageError(f"{flag}: {exc} (a time in the files that cannot rank: 0, infinite or hand-edited)") from None


def merged_from(arch: str = "sm90", results: Path = Path("docs/results")) -> list[Path]:
    """The sweep files the packaged `arch` table names in its provenance (`files`, written by `_merge`), in merge
    order, under `results` (the checkout's docs/results/ by default, from its root): what rebuilds the table, what a
    device session resumes (tools/h200-session.sh TUNE_FROM=packaged). Empty where the table names none."""
    packaged = table_load(arch)
    return [results / n for n in (packaged or {}).get("provenance", {}).get("files", [])]


def _gpu_of(header: dict[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    """A session's GPU: its name and compute capability (None on a CPU run)."""
    gpus = header["environment"]["probe"].get("gpus") or []
    return (str(gpus[0].get("name")), tuple(gpus[0]["capability"])) if gpus else ("cpu", None)


def _merge(files: list[Path], arch: str | None) -> dict[str, Any]:
    headers, results = [], []
    header_files: list[tuple[Path, dict[str, Any]]] = []
    for f in files:
        if not f.is_file():
            raise UsageError(f"--merge: {f} does not exist")
        lines = _read_lines(f)
        head = [r for r in lines if r.get("header")]
        if not head:
            raise UsageError(f"--merge: {f} is not an attnkit tune file (no header line)")
        if not all(isinstance(h.get("environment"), dict) and isinstance(h["environment"].get("probe"), dict)
                   and isinstance(h.get("grid"), dict) for h in head):
            raise UsageError(f"--merge: {f}: its header line lacks what `attnkit tune` writes (environment, grid)")
        headers += head
        header_files += [(f, h) for h in head]
        results += _tagged_cases(lines)
    results = latest_passes(results)
    # one architecture, one software stack; the GPU model may differ (an H100's cases beside an H200's, both
    # sm90): a case's scores are ratios measured within one run on one card, and on the 11 held-out shapes both
    # cards timed on 2026-12-05, the backend fastest on the H100, run on the H200, took 0.998 of the H200's fastest
    # time's speed (geomean over 36 calls, min 0.954), where a neighbour cell standing in for a missing one scores
    # 0.955 (--hide-cell)
    first = {**machine(headers[0]["environment"]), "capability": _gpu_of(headers[0])[1], "gpus": None}
    for f, h in header_files:
        this = {**machine(h["environment"]), "capability": _gpu_of(h)[1], "gpus": None}
        diff = next((k for k in ("capability", "driver", "torch", "libraries") if this[k] != first[k]), None)
        if diff is not None:
            raise UsageError(f"--merge: {f} (session {h['environment'].get('date')}): {diff} {this[diff]}, the first "
                             f"file's {first[diff]}; one table is one GPU architecture and software stack (GPU models "
                             "of one architecture may be mixed)")
    count: dict[str, int] = {}  # passes timed per GPU, in the order the files first name each GPU
    for h in headers:
        count.setdefault(_gpu_of(h)[0], 0)
    for r in results:
        for gpu in r["_gpus"].values():
            count[gpu] = count.get(gpu, 0) + 1
    main_gpu = max(count, key=lambda g: count[g])  # a tie: the GPU the files name first
    env = next(h["environment"] for h in headers if _gpu_of(h)[0] == main_gpu)
    gpus = env["probe"].get("gpus") or []
    arch = arch or (f"sm{gpus[0]['capability'][0]}{gpus[0]['capability'][1]}" if gpus else "cpu")
    # cases that land on one point of one cell (a causal and a non-causal decode are the same call) are
    # combined: a backend's score is its mean over them, where it ran in all of them
    # (and since 2026-12-06 only where they have one sequence length: Rule.far_seqlen_log2 can tell them apart)
    grouped: dict[tuple[str, int, float, float], list[tuple[dict[str, float], dict[str, Any], str]]] = {}
    for r in results:
        if not (type(r.get("head_dim")) is int and 0 < r["head_dim"] <= 4096 and _positive(r.get("log2_work"))
                and r["log2_work"] < 200):
            raise UsageError(f"--merge: case {str(r.get('shape', {}).get('label'))[:60]}: head_dim or log2_work is not "
                             "what `attnkit tune` writes")
        try:
            ls = round(log2_seqlen(_call_of(r["shape"], False)), 1)
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"--merge: case {str(r.get('shape', {}).get('label'))[:60]}: its shape is not what "
                             f"`attnkit tune` writes ({type(exc).__name__}: {first_line(exc, 80)})") from None
        for ps, cell in r.get("cell", {}).items():
            sc = scores(r, ps)
            if sc:
                grouped.setdefault((cell, r["head_dim"], round(r["log2_work"], 1), ls), []).append((sc, r, ps))
    cells: dict[str, list[dict[str, Any]]] = {}
    for (cell, hd, lw, ls), members in grouped.items():
        common = set.intersection(*(set(sc) for sc, _, _ in members))
        mean = {n: statistics.fmean(sc[n] for sc, _, _ in members) for n in common}
        rest = {n: x for sc, _, _ in members for n, x in sc.items() if n not in common}
        ms = {n[len("attnkit:"):]: {m: round(v[ps][m], 5) for m in ("sync", "b2b")}
              for sc, r, ps in members[:1] for n, v in r["ms"].items() if n.startswith("attnkit:") and ps in v}
        point = {"head_dim": hd, "log2_work": lw, "log2_seqlen": ls, "order": ranked(mean) + ranked(rest),
                 "scores": {n: round(x, 4) for n, x in sorted(mean.items())},
                 "cases": [r["shape"]["label"] for _, r, _ in members], "ms": ms}
        measured_on = {r["_gpus"][ps] for _, r, ps in members}
        if measured_on != {main_gpu}:  # measured (in part) on another card of the architecture: said where it decides
            point["gpus"] = sorted(measured_on)
        cells.setdefault(cell, []).append(point)
    for pts in cells.values():
        pts.sort(key=lambda p: (p["head_dim"], p["log2_work"], p["log2_seqlen"]))
    return {"schema": SCHEMA, "arch": arch, "generated_by": "attnkit tune --merge (do not edit by hand)",
            "provenance": {"date": max(h["environment"]["date"] for h in headers),
                           "sessions": sorted({h["environment"]["date"] for h in headers}), **machine(env),
                           **({"passes_per_gpu": dict(sorted(count.items()))} if len(count) > 1 else {}),
                           "grid": headers[0]["grid"],
                           "shards": sorted({h["shard"] for h in headers}), "cases": len(results),
                           # the sweep files by name, in merge order (later passes replace earlier ones): what
                           # `tune --merge` must be given to rebuild this table, for a session that resumes it
                           # (tools/h200-session.sh TUNE_FROM=packaged) and for the test that rebuilds it
                           "files": [f.name for f in files]},
            "cells": dict(sorted(cells.items()))}


# -- cross-check: the lookup rule scored on the sweep's own cases -----------------------------------------------

def _call_of(shape: dict[str, Any], grad: bool, device: str = "cuda") -> AttentionCall:
    """The call a recorded case made, as the runtime describes it (no tensors: a case can be tens of GiB), with
    the runtime's own mask normalisation (one causal query is an unmasked decode)."""
    lengths = tuple(shape["lengths"]) if shape.get("lengths") else None
    keys = tuple(shape["lengths_k"]) if shape.get("lengths_k") else lengths
    causal, window = normalise_mask(bool(shape["causal"]), shape["seqlen_q"],
                                    tuple(shape["window"]) if shape.get("window") else None)
    return AttentionCall(device, 0, shape["dtype"], shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                         shape["heads"], shape["kv_heads"], shape["head_dim"], shape["head_dim"], causal,
                         False, window, bool(shape["alibi"]), False, lengths is not None, grad,
                         softcap=bool(shape["softcap"]), lengths_q=lengths, lengths_k=keys)


# runtime/table.py's RULE among the variants it was chosen from (each with RULE's knobs where it names none: the
# head-dim variants came with head_dim_up on 2026-12-03, the far and relax ones before it, at head_dim_up 1)
SIBLING_FIRST = ("kv", "causal")  # rule 1's neighbour order until 2026-12-05: each cell followed by its sibling dtype


def _unsized(**knobs: Any) -> Rule:
    """A variant scored before points had a sequence length (until 2026-12-06): it keeps that meaning."""
    return Rule(far_seqlen_log2=0.0, blend_distance="max", **knobs)


CROSS_CHECK_RULES: dict[str, Rule | None] = {
    "hand-written rows only (no table)": None,
    "own cell and sibling, far 8x": _unsized(far_log2=3.0, relax=()),
    "+ other kv sharing, far 8x": _unsized(far_log2=3.0, relax=("kv",)),
    "+ other kv sharing and causality, far 8x": _unsized(far_log2=3.0, relax=SIBLING_FIRST),
    "own cell and sibling, far 4x": _unsized(relax=()),
    "+ other kv sharing, far 4x": _unsized(relax=("kv",)),
    "+ other kv sharing and causality, far 4x, head dim symmetric": _unsized(head_dim_up=1.0, relax=SIBLING_FIRST),
    "+ other kv sharing and causality, far 4x, head dim below 2x as far": _unsized(head_dim_up=2.0,
                                                                                     relax=SIBLING_FIRST),
    "+ other kv sharing and causality, far 4x, head dim below 3x as far": _unsized(head_dim_up=3.0,
                                                                                     relax=SIBLING_FIRST),
    "+ other kv sharing and causality, far 4x, a relaxed feature 0.25 farther": _unsized(step_cost=0.25,
                                                                                           relax=SIBLING_FIRST),
    "+ other kv sharing and causality, far 4x, a relaxed feature 0.5 farther": _unsized(step_cost=0.5,
                                                                                          relax=SIBLING_FIRST),
    "+ other kv sharing and causality, far 4x, a relaxed feature 1.0 farther": _unsized(step_cost=1.0,
                                                                                          relax=SIBLING_FIRST),
    "+ other kv sharing and causality, far 4x, the nearest point alone (until 2026-12-05)": _unsized(
        blend=0.0, relax=SIBLING_FIRST),
    "+ the deciding cell's near points blended (0.1)": _unsized(blend=0.1, blend_sibling=False,
                                                                relax=SIBLING_FIRST),
    "+ the deciding cell's near points blended (1.0)": _unsized(blend=1.0, blend_sibling=False,
                                                                relax=SIBLING_FIRST),
    "+ the deciding cell's near points blended (0.25)": _unsized(blend=0.25, blend_sibling=False,
                                                                 relax=SIBLING_FIRST),
    "+ the deciding cell's and its sibling dtype's near points blended (1.0)": _unsized(blend=1.0,
                                                                                         relax=SIBLING_FIRST),
    "+ the deciding cell's and its sibling dtype's near points blended (0.25)": _unsized(relax=SIBLING_FIRST),
    "the sibling dtype after the other kv sharing (shipped 2026-12-05 to 2026-12-06)": _unsized(),
    "the sibling dtype after the other kv sharing, not blended in": _unsized(blend_sibling=False),
    "the sibling dtype last": _unsized(relax=("kv", "causal", "dtype")),
    # a third distance, the sequence length (keys per sequence), at one work and head dim (2026-12-06)
    "the sequence length a distance too, far 2x": Rule(far_seqlen_log2=1.0, blend_distance="max"),
    "the sequence length a distance too, far 4x": Rule(far_seqlen_log2=2.0, blend_distance="max"),
    "the sequence length a distance too, far 8x (shipped 2026-12-06)": Rule(blend_distance="max"),
    "the sequence length a distance too, far 16x": Rule(far_seqlen_log2=4.0, blend_distance="max"),
    # the blend's votes weighed by the sum of a point's offsets, not the largest (2026-12-06, session 18)
    "the blend weighed by the sum of offsets (shipped since 2026-12-06, session 18)": Rule(),
    "the blend weighed by the sum of offsets, the sequence length far 4x": Rule(far_seqlen_log2=2.0),
    "the blend weighed by the sum of offsets, work far 8x": Rule(far_log2=3.0),
    # the plain call first where it scored within a margin of the first backend (2026-12-06, session 21)
    "the plain call first within 2%": Rule(plain_margin=0.02),
    "the plain call first within 5%": Rule(plain_margin=0.05),
    "the plain call first within 10%": Rule(plain_margin=0.10),
    # rule 4 replaced: the least distant far point decides instead of the hand-written rows (2026-12-06, session 24)
    "far points decide too (no hand-written rows where a table exists)": Rule(far_decides=True),
    # a point across head dim 128 from the call counts as far (2026-12-07, session 28: the bench's ALiBi chunk at
    # D128 was decided by a D192 point where flex won, and the plain call won it on the H100): not shipped
    "a point across head dim 128 is far": Rule(head_dim_split=128),
}


def cross_check(files: list[Path], rules: dict[str, Rule | None] | None = None,
                hide_cell: bool = False) -> dict[str, Any]:
    """Leave-one-out over the sweep's cases: each case hidden in turn (with any case merged into the same
    point: the table keeps no per-case split), the table merged from the rest, and the rule's pick for the
    hidden call (a near table point, else the hand-written rows, as the runtime decides) timed by the hidden
    case's own measurement: best / picked per timing mode; a pick that was wrong or did not run in the hidden
    case gives way to the next in its order. Rules are scored side by side, so the lookup is chosen from the whole
    grid's measurements, not from a few validation shapes.
    hide_cell: the hidden call's whole cell is hidden too (each pass decides from the neighbour cells alone), as for
    a real call whose own cell the sweep did not measure (it measures each half-precision cell in one dtype): which
    neighbour stands in best."""
    full = merge(files, flag="--cross-check")
    try:
        return _cross_check(files, full, rules or CROSS_CHECK_RULES, hide_cell)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
        raise UsageError(f"--cross-check: a case of {', '.join(map(str, files))[:200]} is not what `attnkit tune` "
                         f"writes ({type(exc).__name__}: {first_line(exc, 80)})") from None


def _cross_check(files: list[Path], full: dict[str, Any], rules: dict[str, Rule | None],
                 hide_cell: bool = False) -> dict[str, Any]:
    results = latest_passes([r for f in files for r in steady_cases(_read_lines(f))])
    m = re.fullmatch(r"sm(\d+)(\d)", full["arch"])
    cap = (int(m[1]), int(m[2])) if m else None
    device = "cuda" if cap else "cpu"
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in rules}
    skipped = dict.fromkeys(rules, 0)
    for r in results:  # each case hidden once; every rule decides on that one held-out table
        label = r["shape"]["label"]
        cells = {k: kept for k, pts in full["cells"].items() if (kept := [p for p in pts if label not in p["cases"]])}
        held_out = {**full, "cells": cells}
        for ps, recorded in r.get("cell", {}).items():
            t = _times(r, ps)
            c = _call_of(r["shape"], ps == "fwdbwd", device)
            if len(t) < 2 or table_cell(c) != recorded:  # nothing to choose, or not the call it recorded
                for name in rules:
                    skipped[name] += 1
                continue
            best = {m: min(v[m] for v in t.values()) for m in ("sync", "b2b")}
            rows_pick = rows_order(c, cap)[0]
            seen = {**held_out, "cells": {k: v for k, v in cells.items() if k != recorded}} if hide_cell else held_out
            for name, rule in rules.items():
                d = table_decide(c, seen, rule) if rule is not None else None
                order, source = (d.order, "table") if d is not None and not d.far else (rows_pick, "rows")
                pick = next((n for n in order if n in t), None)
                if pick is None:
                    skipped[name] += 1
                    continue
                vs_plain = {f"plain_{m}": t[PLAIN_BACKEND][m] / t[pick][m] for m in ("sync", "b2b")
                            if PLAIN_BACKEND in t}
                rows[name].append({"case": label, "pass": ps, "source": source, "pick": pick,
                                   **{m: best[m] / t[pick][m] for m in ("sync", "b2b")}, **vs_plain})
    return {"files": [str(f) for f in files], "arch": full["arch"], "cases": len(results), "hide_cell": hide_cell,
            "provenance": full["provenance"],
            "rules": {name: {"rule": asdict(rule) if rule is not None else None,
                             "summary": {**_cross_summary(rows[name]), "skipped": skipped[name]},
                             "calls": [{k: round(v, 4) if isinstance(v, float) else v for k, v in x.items()}
                                       for x in rows[name]]}
                      for name, rule in rules.items()}}


# FA4's replay records a signature on its second call, not its first, from this day's sessions on (fa4_replay; the
# review fix 6bf80ce, first run on the H200 on 2026-12-04): a sweep that warmed JIT backends twice then judged
# FA4 on its replay's check call (24 of 69 fwd+bwd cases on 2026-12-04 pruned at 2.5-31 ms, where FA4 ran 0.6-1.5)
SECOND_CALL_RECORDING_SINCE = "2026-12-04"


def unsteady_pruned(r: dict[str, Any], ps: str, session_date: str) -> bool:
    """A pass where FA4 was pruned before it was steady: recorded under a header dated SECOND_CALL_RECORDING_SINCE
    or later by a sweep that gave JIT backends fewer than JIT_WARM_CALLS warm calls (bench/candidates.py)."""
    return (session_date >= SECOND_CALL_RECORDING_SINCE and r.get("jit_warm_calls", 0) < JIT_WARM_CALLS
            and bool(r.get("ms", {}).get(f"attnkit:{REFRESHED_BY}", {}).get(ps, {}).get("pruned")))


def _tagged_cases(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """steady_cases, each pass of each case tagged (`_gpus`) with the GPU of the session header above it (a
    resumed file holds several sessions, possibly on several cards; a refresh may time a case's pass again on
    another card)."""
    out: list[dict[str, Any]] = []
    starts = [i for i, r in enumerate(lines) if r.get("header")]
    if not starts:
        return out
    # lines above the first header (a header cut by a kill): that first header's session, as steady_cases reads them
    for a, b in zip([0, *starts[1:]], [*starts[1:], len(lines)], strict=True):
        seg = lines[a:b]
        gpu = _gpu_of(lines[max(a, starts[0])])[0]
        out += [{**r, "_gpus": {ps: gpu for ps in r.get("cell", {})}} for r in steady_cases(seg)]
    return out


def steady_cases(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The case lines of one file (its lines in order, headers among them), without their `unsteady_pruned`
    passes: such a pass measured FA4 not at all, so it is no measurement, and the case's earlier record of that
    pass (the line a refresh meant to replace) stands in `latest_passes`. A line with no pass left is dropped."""
    out, date = [], ""
    for r in lines:
        if r.get("header"):
            date = str((r.get("environment") or {}).get("date", ""))
            continue
        if "shape" not in r:
            continue
        bad = [ps for ps in r.get("cell", {}) if unsteady_pruned(r, ps, date)]
        if bad:
            r = json.loads(json.dumps(r))
            for ps in bad:
                del r["cell"][ps]
                for v in r.get("ms", {}).values():
                    v.pop(ps, None)
            if not r["cell"]:
                continue
        out.append(r)
    return out


def done_labels(lines: list[dict[str, Any]]) -> set[str]:
    """The cases a resumed sweep need not run again: those whose every pass (fwd, and fwdbwd for training) has a
    steady measurement (`steady_cases`); a case that lost a pass there is planned again."""
    return {r["shape"]["label"] for r in latest_passes(steady_cases(lines))
            if set(r.get("cell", {})) >= ({"fwd", "fwdbwd"} if r["shape"].get("train") else {"fwd"})}


def _sweep_lines(path: Path, flag: str, hint: str = "") -> list[dict[str, Any]]:
    """`path`'s lines, refused in one line when it has text but no header (a table, a report, not a sweep's)."""
    lines = _read_lines(path)
    if path.exists() and path.stat().st_size and not any(r.get("header") for r in lines):
        raise UsageError(f"{flag}: {path} is not an `attnkit tune` results file (no header line){hint}")
    return lines


def measured(files: list[Path], flag: str = "--out") -> set[str]:
    """The cases these result files have measured already (`done_labels` over them all): what a resumed run skips,
    and what `--plan --out` leaves out of the listing."""
    lines = [r for f in files for r in _sweep_lines(f, flag)]
    return _parsed(flag, files, lambda: done_labels(lines))


def cold_pruned(r: dict[str, Any], ps: str) -> bool:
    """A forward pass recorded before bench_shape warmed JIT backends twice ("jit_warmed"), where FA4 was pruned:
    it was judged on its replay's record and check calls (fa4_replay), not on its speed (2026-12-03: 45 of the 454
    cases' forwards, pruned at 0.23-18 ms where the replayed kernel runs in tens of us). Such a pass measured
    FA4 not at all, so it decides nothing (`_times`): the cell's other points and its neighbours do."""
    return (ps == "fwd" and not r.get("jit_warmed")
            and bool(r.get("ms", {}).get(f"attnkit:{REFRESHED_BY}", {}).get(ps, {}).get("pruned")))


def _times(r: dict[str, Any], ps: str) -> dict[str, dict[str, float]]:
    """A case's correct forced backends and their (sync, b2b) times for one pass (none for a `cold_pruned` one)."""
    p = "attnkit:"
    if cold_pruned(r, ps):
        return {}
    return {n[len(p):]: v[ps] for n, v in r["ms"].items() if n.startswith(p) and ps in v
            and n not in r.get("wrong", {}) and all(_positive(v[ps].get(m)) for m in ("sync", "b2b"))}


def _cross_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"calls": 0}
    worst = [min(x["sync"], x["b2b"]) for x in rows]
    # the pick against the plain call, where the case timed it: the sweep times it as PLAIN_BACKEND forced (`sdpa`,
    # torch choosing its own kernel: the plain call's route since 2026-12-06, session 20)
    timed = [x for x in rows if "plain_sync" in x]
    plain = [min(x["plain_sync"], x["plain_b2b"]) for x in timed]
    vs_plain = {} if not plain else {
        "vs_plain_calls": len(plain),
        **{f"vs_plain_geomean_{m}": _geomean(x[f"plain_{m}"] for x in timed) for m in ("sync", "b2b")},
        "vs_plain_share_below_0.98": round(sum(w < 0.98 for w in plain) / len(plain), 3),
        "vs_plain_min_worse_mode": round(min(plain), 4)}
    return {"calls": len(rows), "decided_by_table": sum(x["source"] == "table" for x in rows),
            **{f"geomean_{m}": _geomean(x[m] for x in rows) for m in ("sync", "b2b")},
            "share_both_modes_ge_0.90": round(sum(w >= 0.9 for w in worst) / len(worst), 3),
            "min_worse_mode": round(min(worst), 4), **vs_plain}


# -- held-out validation ---------------------------------------------------------------------------------------

def validation_shapes(quick: bool) -> list[Shape]:
    """Shapes kept apart from the grid: odd head dims and lengths, odd head counts, real model configurations."""
    if quick:
        return [Shape("val odd D48 S77 H20/4 fp32", 2, 20, 4, 77, 77, 48, "float32"),
                Shape("val ALiBi H6 S100 fp32", 2, 6, 6, 100, 100, 64, "float32", alibi=True, train=False)]
    return [
        Shape("val Llama-3-8B prefill S3000 GQA 32/8", 2, 32, 8, 3000, 3000, 128),
        Shape("val Falcon-7B MQA 71/1 S2048", 4, 71, 1, 2048, 2048, 64),
        Shape("val Qwen2 H20/4 D128 S1500 causal", 4, 20, 4, 1500, 1500, 128),
        Shape("val ViT-L S577 D64 non-causal fp16", 32, 16, 16, 577, 577, 64, "float16", causal=False, train=False),
        Shape("val SD UNet S4096 D40 non-causal fp16", 8, 8, 8, 4096, 4096, 40, "float16", causal=False, train=False),
        Shape("val Whisper enc S1500 D64 fp16", 16, 20, 20, 1500, 1500, 64, "float16", causal=False),
        Shape("val BLOOM ALiBi S2048 H32 D128", 2, 32, 32, 2048, 2048, 128, alibi=True),
        Shape("val Gemma2 softcap window D256 S4096", 1, 16, 8, 4096, 4096, 256, window=(4095, 0), softcap=50.0),
        Shape("val Mistral window decode Sk8000", 32, 32, 8, 1, 8000, 128, window=(4096, 0), train=False),
        Shape("val D96 train S1800", 8, 24, 24, 1800, 1800, 96),
        Shape("val spec decode Sq5 Sk6000", 16, 32, 8, 5, 6000, 128, train=False),
        # the call classes the held-out suite names that the shapes above leave out: packed encoders (short and very
        # short sequences, not causal) and fp16 MHA training
        varlen("val packed encoder x64 24-200 H12 D64", mixed_lengths(64, 24, 200, 11), heads=12, kv_heads=12,
               head_dim=64, causal=False),
        varlen("val packed short x400 4-48 H8 D32", mixed_lengths(400, 4, 48, 12), heads=8, kv_heads=8, head_dim=32,
               causal=False),
        Shape("val GPT-2-medium fp16 train S1000 H16 D64", 8, 16, 16, 1000, 1000, 64, "float16"),
    ]


def validate(out: Path | None, quick: bool = False, say: Any = print, resume: bool = False,
             match: str | None = None) -> dict[str, Any]:
    """`resume`: `out` is an earlier run's report, cut by its time limit; its shapes are kept and the rest timed
    (2026-12-05: the 14 shapes took more than one 420 s command on an H100). `match`: only the shapes whose label
    it finds (re.search), the rest left for a later --resume (the last shapes of the list, first)."""
    device = measuring_device("tune --validate")
    quick = quick or device == "cpu"
    shapes = matching(validation_shapes(quick), match)
    if not shapes:  # refused before anything is read or timed
        raise UsageError(f"--match: {str(match)[:80]!r} finds none of the held-out shapes --validate times here "
                         f"(labels look like {validation_shapes(quick)[0].label!r})")
    env = environment()
    rows: list[dict[str, Any]] = []
    if resume and out is not None and out.exists():
        rows, sessions = validation_resumed(out, env, quick)
        env = {**env, "sessions": [*sessions, env["date"]]}  # the report's date is its latest session's
    done = {r["shape"] for r in rows}
    for s in shapes:
        if s.label in done:
            continue
        r = bench_shape(s, device, iters=3 if quick else 10, rounds=2 if quick else 4, confirm=3)
        # every candidate's times too: a later lookup rule can be scored on this run's measurements offline
        row = {"shape": s.label, "params": asdict(s), "selected": r["selected_by_pass"], "decided_by": r["row"],
               "ratios": {},
               "ms": r["ms"], "wrong": sorted(r.get("wrong", {}))}
        for ps, modes in r["ratios"].items():
            for mode, x in modes.items():
                row["ratios"][f"{ps}_{mode}"] = {"selected_over_oracle": round(x["selected_over_oracle"], 3),
                                                 "oracle": x["oracle"],
                                                 "selected_over_sdpa_plain": round(x.get("selected_over_sdpa_plain",
                                                                                         0.0), 3)}
                again = r.get("confirmed", {}).get(ps, {}).get(mode)
                if again is not None:  # the head-to-head rerun: attnkit against the race's fastest other
                    row["ratios"][f"{ps}_{mode}"].update(
                        confirmed_selected_over_oracle=round(min(1.0, again["selected_over_it"]), 3),
                        confirmed_against=again["against"])
        rows.append(row)
        say(f"validate {s.label}: {json.dumps(row['ratios'])}")
        if out is not None:  # each shape as it lands: a run stopped by its time limit keeps what it measured
            write_atomic(out, json.dumps(_validation_report(rows, env, device), indent=1, default=str))
    return _validation_report(rows, env, device)


def validation_resumed(out: Path, env: dict[str, Any], quick: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of an earlier --validate report and the dates of its sessions (run.resumed_rows: the same GPU,
    driver, torch and libraries, the same shape set as this run (`quick`), each shape with its parameters now)."""
    return resumed_rows(
        out, env, {s.label: s for s in validation_shapes(quick)}, what="`attnkit tune --validate --out`",
        bad="a shape without its ratios and times, a ratio that is not a number > 0",
        row_ok=lambda r: (isinstance(r["ratios"], dict) and isinstance(r["ms"], dict)
                          and all(isinstance(x, dict) and _positive(x["selected_over_oracle"])
                                  for x in r["ratios"].values())),
        label_key="shape", params_key="params",
        shape_set=f"this run's validation shapes ({'--quick' if quick else 'the full set'})")


def rescore(report: Path) -> dict[str, Any]:
    """A --validate report's shapes decided again by the runtime as it is now (its table, rule and rows), each
    pick timed by that report's own measurement of the backend forced (`attnkit:<name>`), against the report's
    fastest correct candidate: a new table or rule is scored on the held-out shapes without a GPU, and it is
    known whether the report's figures still stand for what ships (`same_pick`)."""
    where = f"--rescore: {report}"
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
        rows, probe = data["shapes"], data["environment"]["probe"]
        cap = tuple(probe["gpus"][0]["capability"]) if probe.get("gpus") else None
        if cap is not None and not (len(cap) == 2 and all(type(x) is int and 0 <= x < 100 for x in cap)):
            raise ValueError(f"capability {list(cap)[:3]} is not [major, minor]")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise UsageError(f"{where}: not an `attnkit tune --validate --out` report ({type(exc).__name__}: "
                         f"{first_line(exc, 80)})") from None
    from attnkit.runtime.table import TableError
    try:
        out = _rescore_rows(rows, cap, where)
    except TableError as exc:  # the table it decides from ($ATTNKIT_SELECTION_DIR), not the report, is at fault
        raise UsageError(str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError) as exc:
        raise UsageError(f"{where}: a shape's times are not what `attnkit tune --validate` writes "
                         f"({type(exc).__name__}: {first_line(exc, 80)})") from None
    summary = {}
    for ps in ("fwd", "fwdbwd"):
        for mode in ("sync", "b2b"):
            vals = [r[mode] for r in out if r["pass"] == ps]
            if vals:
                summary[f"{ps}_{mode}"] = {"geomean": _geomean(vals), "min": min(vals), "shapes": len(vals)}
    return {"report": str(report), "calls": out, "summary": summary,
            "same_picks": sum(r["same_pick"] for r in out), "picks": len(out)}


def _rescore_rows(rows: list[dict[str, Any]], cap: tuple[int, ...] | None, where: str) -> list[dict[str, Any]]:
    from attnkit.runtime.priority import order_for

    known = {s.label: s for quick in (False, True) for s in validation_shapes(quick)}
    device = "cuda" if cap else "cpu"
    out: list[dict[str, Any]] = []
    for row in rows:
        s = known.get(str(row.get("shape")))
        if s is None:
            raise UsageError(f"{where}: shape {str(row.get('shape'))[:60]!r} is not one of tune.validation_shapes "
                             "(a report from another attnkit version)")
        if "params" in row and not same_params(row["params"], s):
            raise UsageError(f"{where}: shape {s.label[:60]!r} was measured with other parameters than "
                             "tune.validation_shapes gives it now (a report from another attnkit version)")
        wrong = set(row.get("wrong", []))  # bench_shape's forward check: those were not timed in either pass
        for ps in ("fwd", "fwdbwd") if s.train else ("fwd",):
            ms = {n: v[ps] for n, v in row["ms"].items() if ps in v and n not in wrong}
            bad = next(((n, m, t[m]) for n, t in ms.items() for m in ("sync", "b2b") if not _positive(t[m])), None)
            if bad is not None:  # 0, NaN, negative or text: a ratio of it would be one too
                raise ValueError(f"{bad[0]} {ps} {bad[1]} time {str(bad[2])[:20]} is not a number > 0")
            c = _call_of(asdict(s), ps == "fwdbwd", device)
            order, decision = order_for(c, cap)  # type: ignore[arg-type]
            pick = next((n for n in order if f"attnkit:{n}" in ms), None)
            if pick is None:  # no backend of the order was measured there (or each was wrong): nothing to score
                continue
            r = {"shape": s.label, "pass": ps, "pick": pick, "decided_by": decision.describe(),
                 "same_pick": pick == row.get("selected", {}).get(ps)}
            for mode in ("sync", "b2b"):
                r[mode] = round(min(v[mode] for v in ms.values()) / ms[f"attnkit:{pick}"][mode], 3)
            out.append(r)
    return out


def _geomean(vals: Any) -> float:
    """Of ratios, rounded as the reports print them; a ratio rounded to 0 (a pick 2000x slower) still has a log."""
    return round(math.exp(statistics.fmean(math.log(max(v, 1e-6)) for v in vals)), 3)


def _validation_report(rows: list[dict[str, Any]], env: dict[str, Any], device: str) -> dict[str, Any]:
    summary = {}
    for key in sorted({k for r in rows for k in r["ratios"]}):
        vals = [r["ratios"][key]["selected_over_oracle"] for r in rows if key in r["ratios"]]
        summary[key] = {"geomean": _geomean(vals), "min": min(vals), "shapes": len(vals)}
        again = [r["ratios"][key]["confirmed_selected_over_oracle"] for r in rows
                 if "confirmed_selected_over_oracle" in r["ratios"].get(key, {})]
        if again:
            summary[key].update(confirmed_geomean=_geomean(again), confirmed_min=min(again))
    return {"environment": env, "device": device, "shapes": rows, "summary": summary,
            "candidates_note": f"oracle = fastest correct candidate among every forced backend, the libraries' "
                               f"own calls and {PLAIN}; selected = {AUTO}; confirmed = {AUTO} raced again, head "
                               "to head with 3x the samples, against the race's fastest other candidate (the "
                               "race's minimum over many noisy timings is biased low)"}

