"""Two selection variants scored by leave-one-out over the packaged sweep files, beside the shipped rule, and not
shipped (docs/results.md, session 24):
- `Rule.far_decides`: where every cell's nearest point is far, the least distant one decides instead of the
  hand-written rows (the issue asked for the rows only where no table exists);
- the 'sliding window, forward' row (runtime/priority.py, shipped) against the rows as they were (without it) and
  against the whole 'sliding window' row moved ahead instead (`row_variants`);
- mode-aware picks: a call that finds the GPU idle takes the backend fastest with a sync after every call, one that
  finds work queued the backend fastest back to back (each mode's own order, instead of the worse-mode ratio).
  Scored by merging the table with each mode's ratios and timing each mode's pick in that mode only.

  python tools/score-selection-variants.py OUT.json SWEEP.jsonl...   (run from docs/results/ with the 15 files)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import attnkit.bench.tune as tune
from attnkit.runtime.table import RULE, Rule

SHIPPED = "the blend weighed by the sum of offsets (shipped since 2026-12-06, session 18)"
ROW = "sliding window, forward"
FAR = "far points decide too (no hand-written rows where a table exists)"


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 4)


def mode_aware(files: list[Path], hide_cell: bool) -> dict[str, object]:
    """Each mode's picks from a table merged with that mode's ratios alone, timed in that mode."""
    worst = tune.scores
    out: dict[str, object] = {}
    try:
        for mode in ("sync", "b2b"):
            def one_mode(result: dict, ps: str, mode: str = mode) -> dict[str, float]:
                t = tune._times(result, ps)
                if not t:
                    return {}
                best = min(v[mode] for v in t.values())
                return {n: v[mode] / best for n, v in t.items()}
            tune.scores = one_mode
            rows = tune.cross_check(files, {"mode": RULE}, hide_cell)["rules"]["mode"]["calls"]
            out[mode] = {"calls": len(rows), f"geomean_{mode}": _geomean([r[mode] for r in rows]),
                         f"below_0.98_of_plain_{mode}": round(
                             sum(r.get(f"plain_{mode}", 1.0) < 0.98 for r in rows) / len(rows), 3)}
    finally:
        tune.scores = worst
    return out


def with_rows(files: list[Path], rows: tuple, hide_cell: bool) -> dict[str, object]:
    """The rows-only and shipped rules with other hand-written rows."""
    from attnkit.runtime import priority

    shipped = priority.ROWS
    priority.ROWS = rows
    try:
        names = ("hand-written rows only (no table)", SHIPPED)
        rep = tune.cross_check(files, {n: tune.CROSS_CHECK_RULES[n] for n in names}, hide_cell)
        return {n: r["summary"] for n, r in rep["rules"].items()}
    finally:
        priority.ROWS = shipped


def row_variants() -> dict[str, tuple]:
    """The rows before 2026-12-06 (session 24), and the whole 'sliding window' row moved ahead instead."""
    from attnkit.runtime import priority

    before = tuple(r for r in priority.ROWS if r.label != ROW)
    labels = [r.label for r in before]
    window = before[labels.index("sliding window")]
    rest = [r for r in before if r is not window]
    at = [r.label for r in rest].index("chunked prefill and speculative decoding")
    return {f"without the row {ROW!r} (the rows before 2026-12-06, session 24)": before,
            "the whole 'sliding window' row (training too) ahead of 'chunked prefill' instead":
                (*rest[:at], window, *rest[at:])}


def main() -> None:
    out, files = Path(sys.argv[1]), [Path(f) for f in sys.argv[2:]]
    report: dict[str, object] = {"files": [str(f) for f in files]}
    for hide in (False, True):
        rules: dict[str, Rule | None] = {n: tune.CROSS_CHECK_RULES[n]
                                         for n in ("hand-written rows only (no table)", SHIPPED, FAR)}
        rep = tune.cross_check(files, rules, hide)
        report["hide_cell" if hide else "leave_one_out"] = {
            "cases": rep["cases"], **{n: r["summary"] for n, r in rep["rules"].items()},
            "mode-aware picks (each mode's own order)": mode_aware(files, hide),
            **{name: with_rows(files, rows, hide) for name, rows in row_variants().items()}}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
