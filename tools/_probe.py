"""What the tools/probe-*.py scripts share: a profiled run of synced steps, read back as trace events, and the
report each writes (the first paragraph of its docstring, the date, the GPU, torch)."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of a probe itself


def profiled_steps(fn: Callable[[], Any], steps: int, warm: int = 3, with_stack: bool = False) -> tuple[list, list]:
    """`warm` + `steps` calls of `fn`, each a `step{i}` annotation with a device sync inside, under torch.profiler:
    (the last `steps` annotations in time order, every complete trace event)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=acts, with_stack=with_stack) as prof:
        for i in range(warm + steps):
            with record_function(f"step{i}"):
                fn()
                if DEV == "cuda":
                    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("step")),
                   key=lambda e: e["ts"])
    return marks[warm:], events


def write_report(doc: str, unit: str, rows: list[dict[str, Any]]) -> None:
    """The report to argv[1], when given."""
    report = {"what": doc.split("\n\n")[0], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "unit": unit, "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


def run_cases(doc: str, unit: str, cases: list[tuple[Any, ...]], one: Callable[..., dict[str, Any]],
              shown: Callable[[str], bool]) -> None:
    """`one(*case)` for each case, its row printed (the keys `shown` keeps) and the report rewritten after each: one
    case's failure is its row, not the probe's end, and a time limit keeps the rows that landed."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        try:
            rows.append(one(*case))
        except Exception as e:
            rows.append({"case": case[0], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        r = rows[-1]
        print("case", r["case"], {k: v for k, v in r.items() if shown(k) or k.startswith("error")}, flush=True)
        write_report(doc, unit, rows)


def race(runs: dict[str, Callable[[], Any]]) -> dict[str, dict[str, float]]:
    """Each call's median ms in one interleaved race, with a sync per call and back to back (bench.timer's sample
    counts, set by the fastest call of a short first race)."""
    from attnkit.bench.timer import b2b_calls, interleaved, sync_iters

    fast = min(interleaved(runs, DEV, iters=3).values())
    s = interleaved(runs, DEV, iters=sync_iters(fast, 12))
    bb = interleaved(runs, DEV, iters=12, calls=b2b_calls(fast))
    return {n: {"sync_ms": round(s[n] * 1e3, 4), "b2b_ms": round(bb[n] * 1e3, 4)} for n in runs}
