"""Selection variants scored by leave-one-out over the packaged sweep files, beside the shipped rule and rows
(docs/results.md, session 24):
- the 'small windowed forward' row (runtime/priority.py, shipped) against the rows as they were (without it) and
  against moving the whole 'sliding window' row (training too) ahead of 'chunked prefill' instead (`row_variants`);
- the ALiBi rows ahead of 'chunked prefill' for calls from 2^33 work (shipped 2026-12-07, session 26) against where
  they stood before, after 'small' (`alibi_rows_before`), with the calls whose pick the move changes;
- `Rule.far_decides` (not shipped): where every cell's nearest point is far, the least distant one decides instead
  of the hand-written rows (the issue asked for the rows only where no table exists);
- mode-aware picks (not shipped): a call that finds the GPU idle takes the backend fastest with a sync after every
  call, one that finds work queued the backend fastest back to back (each mode's own order, instead of the
  worse-mode ratio). Scored by merging the table with each mode's ratios and timing each mode's pick in that mode
  only; against the plain call, each mode's share below 0.98 over the calls that timed it, beside the shipped
  rule's measured the same way.

  python tools/score-selection-variants.py OUT.json [SWEEP.jsonl...]   (none: the files the packaged table names)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attnkit.bench.tune as tune
from attnkit._io import write_atomic
from attnkit.runtime import priority
from attnkit.runtime.table import RULE

ROWS_ONLY = "hand-written rows only (no table)"
SHIPPED = "the blend weighed by the sum of offsets (shipped since 2026-12-06, session 18)"
FAR = "far points decide too (no hand-written rows where a table exists)"
ROW = "small windowed forward"
ALIBI = ("ALiBi training", "ALiBi forward")
MODES = ("sync", "b2b")


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 4)


def per_mode(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One timing mode's geomean against the fastest, and its share below 0.98 of the plain call (over the calls
    whose case timed the plain call)."""
    timed = [r[f"plain_{mode}"] for r in rows if f"plain_{mode}" in r]
    return {f"geomean_{mode}": _geomean([r[mode] for r in rows]), "plain_calls": len(timed),
            f"below_0.98_of_plain_{mode}": round(sum(x < 0.98 for x in timed) / len(timed), 3)}


def mode_aware(files: list[Path], hide_cell: bool) -> dict[str, Any]:
    """Each mode's picks from a table merged with that mode's ratios alone, timed in that mode."""
    worst = tune.scores
    out: dict[str, Any] = {}
    try:
        for mode in MODES:
            def one_mode(result: dict[str, Any], ps: str, mode: str = mode) -> dict[str, float]:
                t = tune._times(result, ps)
                if not t:
                    return {}
                best = min(v[mode] for v in t.values())
                return {n: v[mode] / best for n, v in t.items()}
            tune.scores = one_mode
            rows = tune.cross_check(files, {"mode": RULE}, hide_cell)["rules"]["mode"]["calls"]
            out[mode] = {"calls": len(rows), **per_mode(rows, mode)}
    finally:
        tune.scores = worst
    return out


@contextlib.contextmanager
def rows_as(rows: tuple[Any, ...]) -> Iterator[None]:
    """runtime/priority.py's hand-written rows replaced by `rows` for the block."""
    shipped = priority.ROWS
    priority.ROWS = rows
    try:
        yield
    finally:
        priority.ROWS = shipped


def with_rows(files: list[Path], rows: tuple[Any, ...], hide_cell: bool) -> dict[str, Any]:
    """The rows-only and shipped rules with other hand-written rows."""
    with rows_as(rows):
        rep = tune.cross_check(files, {n: tune.CROSS_CHECK_RULES[n] for n in (ROWS_ONLY, SHIPPED)}, hide_cell)
    return {n: r["summary"] for n, r in rep["rules"].items()}


def alibi_rows_before() -> tuple[Any, ...]:
    """The ALiBi rows where they stood until 2026-12-07 (session 26): after 'small', for calls of any work, so
    'chunked prefill' (FA4, which has no ALiBi, then the plain call with its dense bias) took the large causal
    chunks first."""
    alibi = [r for r in priority.ROWS if r.label in ALIBI]
    rest = [r for r in priority.ROWS if r.label not in ALIBI]
    at = [r.label for r in rest].index("small") + 1
    old = [dataclasses.replace(r, when={k: v for k, v in r.when.items() if k not in ("small", "decode")})
           for r in alibi]
    return (*rest[:at], *old, *rest[at:])


def row_variants() -> dict[str, tuple[Any, ...]]:
    """The rows before 2026-12-06 (session 24), the whole 'sliding window' row moved ahead instead, and the ALiBi
    rows where they stood before 2026-12-07 (session 26)."""
    before = tuple(r for r in priority.ROWS if r.label != ROW)
    window = next(r for r in before if r.label == "sliding window")
    rest = [r for r in before if r is not window]
    at = [r.label for r in rest].index("chunked prefill and speculative decoding")
    return {f"without the row {ROW!r} (the rows before 2026-12-06, session 24)": before,
            "the whole 'sliding window' row (training too) ahead of 'chunked prefill' instead":
                (*rest[:at], window, *rest[at:]),
            "the ALiBi rows after 'small' (before 2026-12-07, session 26)": alibi_rows_before()}


def shipped_calls(files: list[Path], rows: tuple[Any, ...], hide_cell: bool) -> list[dict[str, Any]]:
    """The shipped rule's leave-one-out calls with `rows` as the hand-written rows."""
    with rows_as(rows):
        return list(tune.cross_check(files, {SHIPPED: RULE}, hide_cell)["rules"][SHIPPED]["calls"])


def picks_changed(shipped: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls whose pick differs between two leave-one-out runs of the same calls (the shipped rows, other
    rows), with each pick's worse-mode ratio to the fastest and the shipped pick's to the plain call."""
    if [(a["case"], a["pass"]) for a in shipped] != [(b["case"], b["pass"]) for b in other]:
        raise SystemExit("picks_changed: the two leave-one-out runs did not score the same calls in the same order")
    return [{"case": a["case"], "pass": a["pass"], "decided_by": a["source"], "was": b["pick"],
             "was_worse_mode": round(min(b["sync"], b["b2b"]), 4), "now": a["pick"],
             "now_worse_mode": round(min(a["sync"], a["b2b"]), 4),
             "now_over_plain_worse_mode": round(min(a["plain_sync"], a["plain_b2b"]), 4) if "plain_sync" in a else None}
            for a, b in zip(shipped, other, strict=True) if a["pick"] != b["pick"]]


def alibi_calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The ALiBi calls of a leave-one-out run: how many, their geomean worse-mode ratio to the fastest, and how many
    fall below 0.90 of it (the feature that scored lowest, which led to the move)."""
    worse = [min(c["sync"], c["b2b"]) for c in calls if "|alibi|" in c["case"]]
    return {"calls": len(worse), "geomean_worse_mode": _geomean(worse), "below_0.90": sum(x < 0.90 for x in worse)}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tools/score-selection-variants.py OUT.json [SWEEP.jsonl...] "
                         "(no sweep files: the packaged table's, run from the checkout's root)")
    out, files = Path(sys.argv[1]), [Path(f) for f in sys.argv[2:]] or tune.merged_from()
    report: dict[str, Any] = {"files": [str(f) for f in files]}
    for hide in (False, True):
        rep = tune.cross_check(files, {n: tune.CROSS_CHECK_RULES[n] for n in (ROWS_ONLY, SHIPPED, FAR)}, hide)
        shipped_rows = rep["rules"][SHIPPED]["calls"]
        now, before = shipped_calls(files, priority.ROWS, hide), shipped_calls(files, alibi_rows_before(), hide)
        report["hide_cell" if hide else "leave_one_out"] = {
            "cases": rep["cases"], **{n: r["summary"] for n, r in rep["rules"].items()},
            "the shipped rule, each mode apart": {m: per_mode(shipped_rows, m) for m in MODES},
            "mode-aware picks (each mode's own order)": mode_aware(files, hide),
            **{name: with_rows(files, rows, hide) for name, rows in row_variants().items()},
            "picks the ALiBi rows' move changed": picks_changed(now, before),
            "ALiBi calls, the shipped rule": {"ALiBi rows after 'small' (before)": alibi_calls(before),
                                              "now": alibi_calls(now)}}
    write_atomic(out, json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
