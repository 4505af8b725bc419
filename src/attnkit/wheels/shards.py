"""Sharded compiles: one wheel's compile units split over N CI jobs, then gathered and linked by one job.

The package's setup.py runs unchanged: torch's BuildExtension writes build.ninja and calls `ninja`. The driver
puts a `ninja` of its own first on PATH (this module's `shim_main`), which reads a context file and acts by
mode:
- "plan": lists the compile units of build.ninja (output, source, command) and stops the build there;
- "compile": builds only shard i's units with the real ninja (restoring those already in the object store),
  stores them by key, and stops the build (nothing is linked);
- "link": restores EVERY unit from the object store into the build tree and lets setup.py link; a unit
  missing from the store is an error naming it (a shard that did not run, or ran on other inputs).
Anything else (`ninja --version`, a tool) goes to the real ninja.

An object's key is sha256 over: the source tree's digest (the sdist's sha256, which covers every header, with
the recipe's source patches for the cell), the unit's full compile command with the source and build roots
replaced by placeholders (flags, the arch gencode list, include paths), the toolkit (nvcc --version) and the
torch version. A stale object is never linked: its key differs, so it is simply not found. The store is a flat
folder of `<key>.o` files, which is what CI caches (actions/cache) and passes from shard jobs to the link job
(artifacts).

Shards are balanced by cost, not count: costs come from a measured record (`<unit>: seconds`, from earlier
shard reports), else the recipe's `unit_cost` patterns (relative costs measured per kernel class; scaled to
seconds when a record covers the other units), else 1; units go to the least-loaded shard, largest first
(deterministic, so every shard job computes the same split on its own).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnkit.errors import AttnkitError, UsageError

ENV_CONTEXT = "ATTNKIT_SHARD_CONTEXT"
STOP = 86  # the shim's exit code after a plan or a shard: "done, do not link"
# torch's BuildExtension writes `compile` and `cuda_compile` edges; a setup.py may add its own cuda_compile_* rules
# (FlashAttention-3's hopper/setup.py: cuda_compile_sm80, cuda_compile_sm80_sm90, cuda_compile_sm100 per arch)
COMPILE_RULE = re.compile(r"(compile|cuda_compile(_[A-Za-z0-9_]+)?)\Z")


@dataclass(frozen=True)
class Unit:
    output: str  # the object, relative to the build tree's root
    source: str  # relative to the source root
    command: str  # with <src> and <build> for the roots


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4); shards count from 1."""
    m = re.fullmatch(r"\s*([0-9]{1,6})\s*/\s*([0-9]{1,6})\s*", text or "")  # ASCII digits, a sane count
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise UsageError(f"--shard: expected I/N with 1 <= I <= N (e.g. 2/4), got {text!r}")
    return int(m.group(1)), int(m.group(2))


# -- costs and the split ------------------------------------------------------------------------------------

def unit_cost(unit: Unit, patterns: Mapping[str, float], recorded: Mapping[str, float]) -> tuple[float, str]:
    """(cost, where it came from): a recorded measurement for this source, else the first matching pattern."""
    if unit.source in recorded:
        return float(recorded[unit.source]), "recorded"
    for pattern, cost in patterns.items():
        if fnmatch.fnmatch(unit.source, pattern):
            return float(cost), f"pattern {pattern}"
    return 1.0, "default"


def unit_costs(units: list[Unit], patterns: Mapping[str, float],
               recorded: Mapping[str, float]) -> dict[str, tuple[float, str]]:
    """unit_cost() of every unit, on one scale: where a record covers only some units (a shard that was
    restored, not compiled, measures nothing), the others' pattern costs are converted to seconds by the
    median seconds-per-pattern-unit of the recorded ones, so a measured unit is not weighed against a bare 1."""
    raw = {u.source: unit_cost(u, patterns, recorded) for u in units}
    if not recorded or all(origin == "recorded" for _, origin in raw.values()):
        return raw
    ratios = sorted(recorded[u.source] / unit_cost(u, patterns, {})[0] for u in units if u.source in recorded)
    if not ratios:
        return raw
    scale = ratios[len(ratios) // 2]
    return {src: (c, o) if o == "recorded" else (c * scale, f"{o} x {scale:g} s") for src, (c, o) in raw.items()}


def split(units: list[Unit], n: int, patterns: Mapping[str, float],
          recorded: Mapping[str, float]) -> list[list[tuple[Unit, float]]]:
    """n shards of (unit, cost): largest first onto the least-loaded shard (ties: the lower shard)."""
    cost = unit_costs(units, patterns, recorded)
    costed = sorted(((u, cost[u.source][0]) for u in units), key=lambda uc: (-uc[1], uc[0].source))
    shards: list[list[tuple[Unit, float]]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for u, c in costed:
        i = min(range(n), key=lambda j: (loads[j], j))
        shards[i].append((u, c))
        loads[i] += c
    return shards


def plan_summary(units: list[Unit], n: int, patterns: Mapping[str, float],
                 recorded: Mapping[str, float]) -> dict[str, Any]:
    """The split as data: per shard its units, estimated cost and share of the total."""
    shards = split(units, n, patterns, recorded)
    total = sum(c for s in shards for _, c in s) or 1.0
    sources = sorted({origin.split(" ")[0] for _, origin in unit_costs(units, patterns, recorded).values()})
    return {"shards": n, "units": len(units), "cost_total": round(total, 2), "cost_from": sources,
            "plan": [{"shard": i + 1, "units": [u.source for u, _ in s], "cost": round(sum(c for _, c in s), 2),
                      "share": round(sum(c for _, c in s) / total, 3)} for i, s in enumerate(shards)]}


def print_plan(plan: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{plan['package']} {plan['cell']} (archs {plan['archs']}): {plan['units']} units in "
                    f"{plan['shards']} shards, cost from {', '.join(plan['cost_from'])}")
    for col in ("shard", "units", "est. cost", "share", "largest units"):
        t.add_column(col, justify="right" if col != "largest units" else "left")
    for s in plan["plan"]:
        t.add_row(f"{s['shard']}/{plan['shards']}", str(len(s["units"])), f"{s['cost']:g}", f"{s['share']:.1%}",
                  ", ".join(Path(u).name for u in s["units"][:3]) + (" ..." if len(s["units"]) > 3 else ""))
    Console().print(t)


def project_wall(unit_seconds: Mapping[str, float], shards: int, *, cores: int, memory_gib: float,
                 memory_per_job_gib: float, archs: float = 1.0, overhead_s: float = 0.0,
                 patterns: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Projected wall time of a sharded build from measured seconds per unit (for the arch count they were
    measured at): each shard runner compiles its units with min(cores, memory / per-job) jobs, a unit's time
    scales with the arch count (nvcc compiles each arch separately), and no shard can be shorter than its
    longest unit. `overhead_s`: per-runner set-up (torch, toolkit) plus the link job."""
    units = [Unit(output=src, source=src, command="") for src in unit_seconds]
    jobs = max(1, min(cores, int(memory_gib // memory_per_job_gib)))
    split_ = split(units, shards, patterns or {}, unit_seconds)
    walls = [max(sum(c for _, c in s) / jobs, max((c for _, c in s), default=0.0)) * archs for s in split_]
    return {"shards": shards, "cores": cores, "jobs": jobs, "archs": archs,
            "compile_s": round(max(walls), 1), "wall_s": round(max(walls) + overhead_s, 1)}


def load_recorded(paths: str | Path | list[str] | list[Path] | None) -> dict[str, float]:
    """Measured seconds per source, merged over files (a later file wins): each a JSON object {source:
    seconds}, the shim's shard report, or a `wheels build --shard --report` build report."""
    if paths is None:
        return {}
    merged: dict[str, float] = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise AttnkitError(f"--costs {path}: cannot read a JSON cost record ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("shard"), dict):  # a build report
            data = data["shard"]
        if isinstance(data, dict) and isinstance(data.get("unit_seconds"), dict):
            data = data["unit_seconds"]
        if not isinstance(data, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in data.values()):
            raise AttnkitError(f"--costs {path}: expected {{source: seconds >= 0}}, a shard report or a shard's "
                               "build report with unit_seconds")
        merged.update({str(k): float(v) for k, v in data.items()})
    return merged


# -- keys ---------------------------------------------------------------------------------------------------

def unit_key(unit: Unit, source_digest: str, toolkit: str, torch: str) -> str:
    blob = json.dumps({"source": source_digest, "command": unit.command, "toolkit": toolkit, "torch": torch},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# -- the shim -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Context:
    """What the driver tells the shim (written as JSON, path in $ATTNKIT_SHARD_CONTEXT)."""

    mode: str  # plan | compile | link
    real_ninja: str
    source_root: str
    build_root: str
    store: str
    report: str
    source_digest: str
    toolkit: str
    torch: str
    shard: int = 0
    shards: int = 0
    patterns: dict[str, float] | None = None
    recorded: dict[str, float] | None = None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")


def install_shim(directory: Path, python: str = sys.executable) -> Path:
    """A `ninja` executable in `directory` that runs shim_main with this interpreter; put it first on PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "ninja"
    shim.write_text(f"#!{python}\nimport sys\nfrom attnkit.wheels.shards import shim_main\n"
                    "sys.exit(shim_main(sys.argv[1:]))\n", encoding="utf-8")
    shim.chmod(0o755)
    return shim


def _relative(text: str, ctx: Context) -> str:
    return text.replace(ctx.build_root, "<build>").replace(ctx.source_root, "<src>")


def read_units(real_ninja: str, cwd: Path, ctx: Context) -> list[Unit]:
    """The compile edges of cwd's build.ninja, through ninja's own tools (no parsing of ninja syntax here)."""
    listed = subprocess.run([real_ninja, "-t", "targets", "all"], cwd=cwd, capture_output=True, text=True, check=True)
    outputs = [ln.rsplit(":", 1)[0].strip() for ln in listed.stdout.splitlines()
               if COMPILE_RULE.match(ln.rsplit(":", 1)[-1].strip())]
    units = []
    for out in outputs:
        cmd = subprocess.run([real_ninja, "-t", "commands", "-s", out], cwd=cwd, capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        m = re.search(r"\s-c\s+(\S+)\s+-o\s", cmd)
        source = m.group(1) if m else out
        units.append(Unit(output=_relative(str((cwd / out).resolve()), ctx),
                          source=_relative(source, ctx).removeprefix("<src>/"), command=_relative(cmd, ctx)))
    return sorted(units, key=lambda u: u.source)


def _real_path(rel: str, ctx: Context) -> Path:
    return Path(rel.replace("<build>", ctx.build_root).replace("<src>", ctx.source_root))


def _ninja_log_seconds(cwd: Path, outputs: dict[str, str]) -> dict[str, float]:
    """Seconds per source from .ninja_log (start and end ms of each output's last build)."""
    by_out: dict[str, float] = {}
    try:
        lines = (cwd / ".ninja_log").read_text().splitlines()
    except OSError:
        return {}
    for ln in lines:
        parts = ln.split("\t")
        if len(parts) >= 4 and parts[0].isdigit():
            by_out[str((cwd / parts[3]).resolve())] = (int(parts[1]) - int(parts[0])) / 1000.0
    return {src: round(by_out[out], 2) for out, src in outputs.items() if out in by_out}


def _store_put(obj: Path, store: Path, key: str) -> None:
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".{key}.o.tmp"
    shutil.copyfile(obj, tmp)
    tmp.replace(store / f"{key}.o")


def _store_get(store: Path, key: str, dest: Path) -> bool:
    found = store / f"{key}.o"
    if not found.is_file():
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".restore")
    shutil.copyfile(found, tmp)
    tmp.replace(dest)  # a fresh mtime: newer than its source, so a later ninja run keeps it
    return True


def shim_main(argv: list[str]) -> int:
    ctx_path = os.environ.get(ENV_CONTEXT)
    if not ctx_path:  # "ninja" on PATH would be this shim again: never guess
        print(f"attnkit ninja shim: ${ENV_CONTEXT} is not set (run builds through `attnkit wheels build`)",
              file=sys.stderr)
        return 2
    ctx = Context(**json.loads(Path(ctx_path).read_text(encoding="utf-8")))
    if any(a in ("--version", "-t", "-n") for a in argv):  # a query, not a build: the real ninja answers
        return subprocess.run([ctx.real_ninja, *argv]).returncode
    cwd = Path.cwd()
    units = read_units(ctx.real_ninja, cwd, ctx)
    store = Path(ctx.store)
    keys = {u.output: unit_key(u, ctx.source_digest, ctx.toolkit, ctx.torch) for u in units}
    report: dict[str, Any] = {"mode": ctx.mode, "units": len(units), "build_tree": str(cwd)}
    t0 = time.monotonic()
    if ctx.mode == "plan":
        report["unit_list"] = [asdict(u) for u in units]
        rc = STOP
    elif ctx.mode == "compile":
        mine = [u for u, _ in split(units, ctx.shards, ctx.patterns or {}, ctx.recorded or {})[ctx.shard - 1]]
        restored = [u for u in mine if _store_get(store, keys[u.output], _real_path(u.output, ctx))]
        todo = [u for u in mine if u not in restored]
        jobs = [a for i, a in enumerate(argv) if a.startswith("-j") or (i and argv[i - 1] == "-j")]
        if todo:
            targets = [str(_real_path(u.output, ctx)) for u in todo]
            done = subprocess.run([ctx.real_ninja, "-v", *jobs, *targets])
            if done.returncode != 0:
                return done.returncode
        for u in mine:
            _store_put(_real_path(u.output, ctx), store, keys[u.output])
        report.update(shard=ctx.shard, shards=ctx.shards, shard_units=[u.source for u in mine],
                      compiled=len(todo), restored=len(restored),
                      keys={u.source: keys[u.output] for u in mine},
                      unit_seconds=_ninja_log_seconds(cwd, {str(_real_path(u.output, ctx)): u.source for u in todo}))
        rc = STOP
    elif ctx.mode == "link":
        missing = [u for u in units if not _store_get(store, keys[u.output], _real_path(u.output, ctx))]
        report.update(restored=len(units) - len(missing), missing=[u.source for u in missing],
                      missing_keys={u.source: keys[u.output] for u in missing})
        rc = 2 if missing else 0
    else:
        print(f"attnkit ninja shim: unknown mode {ctx.mode!r}", file=sys.stderr)
        return 2
    report["seconds"] = round(time.monotonic() - t0, 1)
    Path(ctx.report).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return rc
