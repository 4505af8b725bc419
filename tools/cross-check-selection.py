"""Leave-one-out check of the table lookup rule (runtime/table.py) on a sweep's own measurements: each measured
case is hidden in turn, the table is merged from the others, and the rule picks a backend for the hidden call
(a table point where one is near, else the hand-written rows, as the runtime does). The pick's time is read from
the hidden case's measurement: best / picked per timing mode. Variants of the rule's two knobs (FAR_LOG2, and
whether other kv sharing counts as a neighbour) are scored side by side, so the rule is chosen from measurement
across the whole grid, not from the held-out validation shapes.

    python tools/cross-check-selection.py OUT.json TUNE.jsonl [TUNE.jsonl ...]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from attnkit.bench import tune
from attnkit.runtime import priority, table
from attnkit.runtime.call import AttentionCall


def call_of(shape: dict, grad: bool) -> AttentionCall:
    lengths = tuple(shape["lengths"]) if shape.get("lengths") else None
    window = tuple(shape["window"]) if shape.get("window") else None
    return AttentionCall("cuda", 0, shape["dtype"], shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                         shape["heads"], shape["kv_heads"], shape["head_dim"], shape["head_dim"], shape["causal"],
                         False, window, shape["alibi"], False, lengths is not None, grad,
                         softcap=bool(shape["softcap"]), lengths_q=lengths, lengths_k=lengths)


def times(r: dict, ps: str) -> dict[str, dict[str, float]]:
    p = "attnkit:"
    return {n[len(p):]: v[ps] for n, v in r["ms"].items() if n.startswith(p) and ps in v and n not in r.get("wrong", {})
            and all(tune._positive(v[ps].get(m)) for m in ("sync", "b2b"))}


def main() -> None:
    out, files = Path(sys.argv[1]), [Path(f) for f in sys.argv[2:]]
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines() if x.strip()]
    header, cases = next(r for r in lines if r.get("header")), [r for r in lines if "shape" in r]
    full = tune._merge(files, "sm90")
    variants = {f"far={far:g} kv_backoff={kv}": (far, kv) for far in (2.0, 3.0, 4.0) for kv in (False, True)}
    report: dict = {"files": [str(f) for f in files], "cases": len(cases), "variants": {}}
    real_neighbours = table.neighbours
    for name, (far, kv) in variants.items():
        table.FAR_LOG2 = far
        table.neighbours = real_neighbours if kv else (lambda key: [k for k in (key, table.sibling(key)) if k])
        rows = []
        for r in cases:
            label = r["shape"]["label"]
            cells = {}
            for key, pts in full["cells"].items():
                keep = [p for p in pts if label not in p["cases"]]
                if keep:
                    cells[key] = keep
            t = {"schema": table.SCHEMA, "arch": "sm90", "cells": cells}
            for ps in r.get("cell", {}):
                tm = times(r, ps)
                if len(tm) < 2:
                    continue
                c = call_of(r["shape"], ps == "fwdbwd")
                d = table.decide(c, t)
                if d is not None and not d.far:
                    order, source = d.order, "table"
                else:
                    with tempfile.TemporaryDirectory() as empty:  # the rows alone: no table in the folder
                        import os
                        os.environ[table.ENV_TABLES] = empty
                        table.load.cache_clear()
                        order, source = priority.order_for(c, (9, 0))[0], "rows"
                pick = next((n for n in order if n in tm), None)
                if pick is None:
                    continue
                best = {m: min(v[m] for v in tm.values()) for m in ("sync", "b2b")}
                ratio = {m: best[m] / tm[pick][m] for m in ("sync", "b2b")}
                rows.append({"case": label, "pass": ps, "source": source, "pick": pick, **ratio})
        gm = {m: math.exp(statistics.fmean(math.log(x[m]) for x in rows)) for m in ("sync", "b2b")}
        worst = [min(x["sync"], x["b2b"]) for x in rows]
        summary = {"calls": len(rows), "decided_by_table": sum(x["source"] == "table" for x in rows),
                   "geomean_sync": round(gm["sync"], 3), "geomean_b2b": round(gm["b2b"], 3),
                   "share_worst_mode_ge_0.90": round(sum(w >= 0.9 for w in worst) / len(worst), 3),
                   "min_worst_mode": round(min(worst), 3)}
        report["variants"][name] = {"summary": summary, "rows": rows}
        print(name, json.dumps(summary), flush=True)
    report["environment"] = header["environment"]["probe"].get("gpus")
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
