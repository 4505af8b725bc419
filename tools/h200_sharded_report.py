"""Issue 14: turn the H200 sharded-build run's device outputs into docs/results/<date>-h200-sharded-build.json:
seconds per compile unit (finished units from each shard's .ninja_log; units still compiling when the call
ended, as lower bounds from `ps`), and projections through attnkit.wheels.shards.project_wall.

Usage: PYTHONPATH=src python3 tools/h200_sharded_report.py DEVICE_OUT_DIR PLAN_JSON EARLIER_JSON OUT_JSON [PROBE_JSON]
(EARLIER_JSON: the previous report, whose attempts are kept under "earlier_attempts"; PROBE_JSON: a
tools/h200_unit_archs.py result from another machine, which turns two assumptions of the projection into
measured factors: how a unit's CPU time scales from sm_90 to 4 archs, and that machine's core speed against a
loaded H200-host core on the same unit)."""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from pathlib import Path

from attnkit.wheels.recipe import load_recipe
from attnkit.wheels.shards import Unit, plan_summary, project_wall, unit_cost

RUNNERS = {4: 16.0, 16: 64.0}  # GitHub-hosted Linux runners: cores -> GiB of memory
MEMORY_PER_JOB_GIB = 5.0  # flash-attn recipe
OVERHEAD_S = 600.0  # ASSUMED, not measured: compile runner set-up + the link job (see "assumptions")


def unit_source(path: str) -> str:
    """A build-tree object path back to the source it was compiled from, as the plan names it."""
    name = Path(path).name
    if name == "flash_api.o":
        return "csrc/flash_attn/flash_api.cpp"
    return f"csrc/flash_attn/src/{name[:-2]}.cu"


def bounded_row(low: dict[str, float], high: dict[str, float], shards: int, cores: int, mem: float,
                archs: float) -> dict[str, object]:
    """One projection at both bounds of the unit seconds: shards, jobs, compile and wall minutes as [low, high]."""
    lo, hi = (project_wall(d, shards, cores=cores, memory_gib=mem, memory_per_job_gib=MEMORY_PER_JOB_GIB,
                           archs=archs, overhead_s=OVERHEAD_S) for d in (low, high))
    return {"shards": shards, "jobs": lo["jobs"],
            "compile_min": [round(lo["compile_s"] / 60, 1), round(hi["compile_s"] / 60, 1)],
            "wall_min": [round(lo["wall_s"] / 60, 1), round(hi["wall_s"] / 60, 1)]}


def main() -> None:
    out_dir, plan_path, earlier_path, dest = map(Path, sys.argv[1:5])
    probe = json.loads(Path(sys.argv[5]).read_text()) if len(sys.argv) > 5 else None
    logs = json.loads((out_dir / "ninja_logs.json").read_text())
    shards = json.loads((out_dir / "shards.json").read_text())
    status = (out_dir / "status.txt").read_text()
    plan = json.loads(plan_path.read_text())
    finished = {unit_source(o): s for per_shard in logs.values() for o, s in per_shard.items()}
    of_shard = {u: s["shard"] for s in plan["plan"] for u in s["units"]}
    running: dict[str, float] = {}
    for m in re.finditer(r"^running (\S+) (\d+)s$", status, re.M):
        src = f"csrc/flash_attn/src/{m.group(1)}"
        if src not in finished:  # a unit both finished and running is the 4-arch probe's second compile of it
            running[src] = float(m.group(2))
    missing = sorted(set(of_shard) - set(finished) - set(running))

    def klass(src: str) -> str:
        name = Path(src).name
        return ("fwd_split" if "fwd_split" in name else "bwd_causal" if "bwd" in name and "causal" in name
                else "bwd" if "bwd" in name else "fwd_causal" if "causal" in name else "fwd" if "fwd" in name
                else "api")

    by_class: dict[str, list[float]] = {}
    for src, sec in finished.items():
        by_class.setdefault(klass(src), []).append(sec)
    slowest = max(finished.values())
    # the unfinished units: low = what they had run when the call ended; high = that, or the slowest unit
    # measured, whichever is more (no finished fwd_split unit exists to take a class figure from)
    low = {**finished, **running}
    high = {**finished, **{u: max(s, slowest) for u, s in running.items()}}
    projections = []
    for cores, mem in RUNNERS.items():
        for archs in (1, 2, 4):
            for n in (4, 8, 16, 24, 32):
                projections.append({"runner_cores": cores, "runner_memory_gib": mem, "archs": archs,
                                    **bounded_row(low, high, n, cores, mem, archs)})
    four = [p for p in projections if p["runner_cores"] == 4 and p["archs"] == 4]
    measured_factors = None
    if probe is not None:
        unit = f"csrc/flash_attn/src/{probe['unit']}"
        one = probe["sm90_threads1"]
        four_key = next(k for k in probe if k.startswith("sm80_90_100_120_threads"))
        speed = one["cpu_s"] / finished[unit]  # > 1: that machine's core is slower than a loaded H200-host core
        arch4 = probe["cpu_ratio"]
        rows = []
        for cores, mem in RUNNERS.items():
            for n in (8, 16, 24, 32):
                lo_, hi_ = ({u: t * speed for u, t in d.items()} for d in (low, high))
                rows.append({"runner_cores": cores, **bounded_row(lo_, hi_, n, cores, mem, arch4)})
        measured_factors = {
            "probe": {k: probe[k] for k in ("date", "unit", "cpus", "cpu_model", "command_sm90") if k in probe}
            | {"sm90_threads1": one, four_key: probe[four_key], "h200_host_seconds_same_unit": finished[unit]},
            "core_speed_factor": round(speed, 3),
            "arch_cpu_factor_4_archs": arch4,
            "arch_wall_ratio_with_threads": probe["wall_ratio"],
            "how": ("unit seconds measured on the H200 host x core_speed_factor, then x arch_cpu_factor_4_archs "
                    "in place of x4; same model, bounds and overhead as the rows above; 4 archs only"),
            "rows": rows,
            "shards_meeting_target_at_high_bound": [r["shards"] for r in rows
                                                    if r["runner_cores"] == 4 and r["wall_min"][1] <= 60],
        }
    fits = [p["shards"] for p in four if p["wall_min"][1] <= 60]
    # how evenly each way of costing units splits the work, judged on the measured seconds (a unit without a
    # measurement: its pattern cost x the median forward unit)
    patterns = dict(load_recipe("flash-attn")[0].build.unit_cost)
    fwd = statistics.median(by_class["fwd"])
    truth = {u: finished.get(u, unit_cost(Unit(u, u, ""), patterns, {})[0] * fwd) for u in of_shard}
    units = [Unit(output=u, source=u, command="") for u in of_shard]
    balance = {}
    for name, pats, rec in (("patterns before (backward x3)", {"csrc/flash_attn/src/flash_bwd_*": 3.0}, {}),
                            ("recipe patterns now", patterns, {}), ("recorded seconds (--costs)", {}, truth)):
        for n in (4, 16):
            loads = [sum(truth[u] for u in s["units"]) for s in plan_summary(units, n, pats, rec)["plan"]]
            balance[f"{name}, {n} shards"] = {"max_s": round(max(loads)), "min_s": round(min(loads))}
    earlier = json.loads(earlier_path.read_text())
    report = {
        "date": "2026-11-30",
        "status": ("INCOMPLETE: the 4 shards ran side by side for 9 min on the H200 host; 46 of 73 units finished, "
                   "27 were still compiling when the call's time was up; no shard finished, nothing was linked"),
        "cell": plan["cell"], "archs": plan["archs"], "package": "flash-attn 2.8.3.post2",
        "machine": "nvidia-h200-x2 device machine: 32 cores (Intel Xeon, 1 thread per core), 251 GiB, nvcc 13.0, "
                   "torch 2.11.0+cu130, python 3.12; run started 2026-11-30 23:01:15 UTC",
        "how": ("tools/h200-sharded-build.sh start with SHARDS=4 CORES=7: `attnkit wheels build --shard i/4` x 4, "
                "each in a build tree of its own, pinned by taskset to 7 CPUs of its own (4 runners of 7 cores), "
                "--jobs 7, one object store; CPUs 28-31 ran a probe that compiles one unit for 4 archs (it had "
                "not finished its first, sm_90-only compile when the call ended: no figure)"),
        "plan": {"units": plan["units"], "cost_from": plan["cost_from"],
                 "split": [{"shard": s["shard"], "units": len(s["units"]), "est_cost": s["cost"]}
                           for s in plan["plan"]]},
        "measured": {
            "units_finished": len(finished), "units_running_at_end": len(running), "units_unaccounted": missing,
            "seconds_by_class": {k: {"n": len(v), "min": min(v), "median": round(statistics.median(v), 1),
                                     "max": max(v)} for k, v in sorted(by_class.items())},
            "unit_seconds": dict(sorted(finished.items())),
            "running_at_end_seconds_so_far": dict(sorted(running.items())),
            "per_shard_at_end": {k: (v["log_tail"] or "").strip().splitlines()[-1] for k, v in shards.items()},
            "shard_balance_on_measured_seconds": balance,
            "memory": "used 112 GiB at 1.5 min (28 jobs: ~4 GiB each while the front end runs), then 32-52 GiB",
        },
        "findings": [
            "backward units are NOT 3x forward ones, as the recipe's balance assumed: at sm_90, medians "
            + ", ".join(f"{k} {statistics.median(v):.0f} s" for k, v in sorted(by_class.items()))
            + " (one core each, 28 compiles side by side); the recipe's patterns now carry these ratios",
            "slowest shard's measured work at 16 shards: "
            + ", ".join(f"{k.split(',')[0]} {v['max_s']} s" for k, v in balance.items() if k.endswith(" 16 shards"))
            + "; at 4 shards the class patterns do worse than before ("
            + f"{balance['recipe patterns now, 4 shards']['max_s']} vs "
            + f"{balance['patterns before (backward x3), 4 shards']['max_s']} s): units of one class differ by "
            "head dim, which only recorded seconds capture",
            f"no unit took more than {slowest:g} s at sm_90, so past ~16 shards a runner's wall time is set by "
            "its longest unit, not by its share",
        ],
        "projection": {
            "model": ("attnkit.wheels.shards.project_wall: per shard runner, jobs = min(cores, memory / 5 GiB); "
                      "wall = max(sum of its units / jobs, its longest unit) x archs (nvcc_threads 1: archs "
                      "compiled one after another) + overhead; shards split by LPT on these seconds"),
            "bounds": ("each figure is [low, high]: low counts a still-running unit at the seconds it had run, "
                       f"high at max(that, the slowest finished unit, {slowest:g} s)"),
            "assumptions": [f"overhead {OVERHEAD_S / 60:g} min per wheel (runner set-up + link job): NOT measured "
                            "(no link ran)",
                            "rows: a GitHub runner core as fast as one of these H200-host cores under full load"
                            + ("; with_measured_factors: as fast as the probe machine's core" if probe else ""),
                            "rows: unit time x archs (nvcc compiles each -gencode in turn)"
                            + ("; with_measured_factors: x the probe's measured 4-arch CPU ratio" if probe
                               else ": not measured (the probe did not finish)")],
            "rows": projections,
            "target": "full arch list (4 archs) on 4-core runners <= 60 min",
            "shards_meeting_target_at_high_bound": fits,
            "with_measured_factors": measured_factors,
        },
        "not_shown": ["the link job's time and the linked wheel's verification and GPU check on the H200",
                      "a shard's complete compile time",
                      "the 4-arch scaling of one unit on the H200 host" + (" (measured on the probe machine: "
                                                                           "projection.with_measured_factors)"
                                                                           if probe else "")],
        "why": ("device budget: 30 min per session, 10 min per call, and the machine is handed back 30 s after a "
                "call ends. Call 1 (8 min) ran the same 4 shards; the machine was handed back before call 2 "
                "started, so its work was lost and call 2 (8 min) polled a fresh machine; call 3 is this run "
                "(9 min); 110 s of budget were left after it. The next session (2026-12-01) found the same 110 s "
                "(device time counts earlier tries at the same work) and no machine it could start: the complete "
                "run is blocked here"),
        "earlier_attempts": {k: earlier[k] for k in ("status", "machine", "observed")} if "observed" in earlier
        else earlier.get("earlier_attempts"),
        "shown_on_dev_machine": earlier.get("what_is_shown_instead") or earlier.get("shown_on_dev_machine"),
    }
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, dest)
    print(json.dumps({"fits_4core_4arch_high": fits, "classes": report["measured"]["seconds_by_class"]}, indent=1))


if __name__ == "__main__":
    main()
