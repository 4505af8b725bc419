"""Pipeline stage 3, the compile driver: one package for one cell, natively, with the cell's torch and a
matching CUDA toolkit.

- resumable: the source tree and its build/ folder live in a persistent build dir, and setuptools' ninja
  build only recompiles objects that are missing or stale, so a build stopped by a time limit continues;
- shardable: `shard=(i, n)` compiles only shard i's units and stores them; `link_only` gathers every unit
  from the object store and links (wheels/shards.py);
- progress from ninja's `[done/total]` lines (objects done, elapsed, estimate), and a full log kept;
- the wheel is then accepted (wheels/accept.py): renamed, pinned, verified, moved into the output directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnkit._io import cache_dir
from attnkit._progress import Counter
from attnkit.errors import AttnkitError
from attnkit.wheels import pyenv
from attnkit.wheels.accept import finalize
from attnkit.wheels.recipe import BuildSpec, format_archs
from attnkit.wheels.sizing import jobs_for, memory_used_gib
from attnkit.wheels.source import prepare_source, source_digest
from attnkit.wheels.toolkit import Toolkit, check_major, resolve_toolkit

_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")

def recipe_env(spec: BuildSpec, jobs: int) -> dict[str, str]:
    """The variables that drive the package's setup.py: the recipe's switches, its arch list, parallelism.
    Shared by the native build and `attnkit wheels env` (CI, cibuildwheel)."""
    knobs = spec.recipe.build
    env = dict(knobs.env)
    env.update(spec.options)  # a trimmed test build's recipe options (--option)
    env[knobs.arch_env] = format_archs(list(spec.archs), knobs.arch_format)
    env[knobs.jobs_env] = str(jobs)
    if knobs.nvcc_threads_env:
        env[knobs.nvcc_threads_env] = knobs.nvcc_threads_value.format(threads=knobs.nvcc_threads)
    return env

def build_env(spec: BuildSpec, tk: Toolkit, jobs: int) -> dict[str, str]:
    env = {**os.environ, **recipe_env(spec, jobs)}
    env["CUDA_HOME"] = str(tk.home)
    env["PATH"] = f"{tk.home / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    return env


@dataclass
class BuildReport:
    package: str
    version: str
    cell: str
    wheel: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    seconds: float = 0.0
    jobs: int = 0
    jobs_reason: str = ""
    nvcc_threads: int = 0
    archs: str = ""
    toolkit: str = ""
    objects_total: int | None = None
    objects_compiled_this_run: int = 0
    peak_memory_used_gib: float | None = None
    log: str = ""
    shard: dict[str, Any] | None = None  # the shim's report of a plan, a shard or a link (wheels/shards.py)
    patches: list[str] = field(default_factory=list)  # the recipe's source patches this cell's build applied
    verify: dict[str, Any] = field(default_factory=dict)

def _watch_memory(stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(1.0):
        used = memory_used_gib()
        if used is None:
            return
        out.append(used)

def run_build(spec: BuildSpec, src: Path, env: dict[str, str], python: str, dist: Path, log_path: Path,
              report: BuildReport, stopped: Any = None) -> Path | None:
    """Run `pip wheel` in the source tree (in place, so objects persist), streaming progress. None when
    `stopped()` says the build was stopped on purpose (a plan or a shard: nothing linked)."""
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    cmd = [python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-v",
           "-w", str(dist), str(src)]
    progress = Counter(f"{spec.package} {spec.cell.id}")
    mem: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_memory, args=(stop, mem), daemon=True)
    watcher.start()
    compiled = 0
    try:
        with log_path.open("a", encoding="utf-8") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", start_new_session=True)
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    log.write(line)
                    m = _PROGRESS.match(line.strip())
                    if m:
                        log.flush()  # keep the log live for `tail -f` (and for tests that watch it)
                        compiled += 1
                        progress.update(int(m.group(1)), int(m.group(2)))
                rc = proc.wait()
            except BaseException:
                _stop_session(proc)  # stop nvcc too; objects already written stay
                raise
    finally:
        stop.set()
        progress.close()
    report.objects_total = progress.total or report.objects_total
    report.objects_compiled_this_run = compiled
    report.peak_memory_used_gib = round(max(mem), 2) if mem else None
    if rc != 0 and stopped is not None and stopped():
        return None
    if rc != 0:
        tail = _log_tail(log_path)
        raise AttnkitError(f"build: pip wheel failed for {spec.package} ({tail}); full log: {log_path}")
    wheels = sorted(dist.glob("*.whl"))
    if len(wheels) != 1:
        raise AttnkitError(f"build: expected one wheel in {dist}, found {len(wheels)}; log: {log_path}")
    return wheels[0]

def _session_members(sid: int) -> list[int]:
    """PIDs in session `sid`. ninja puts each compiler in its own process group (so Ctrl-C does not reach
    it), but they all stay in the session that pip was started in."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # session id is field 6; fields[0] is field 3 (state)
            pids.append(int(stat.parent.name))
    return pids

def _stop_session(proc: subprocess.Popen[str]) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in _session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _session_members(proc.pid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        if not _session_members(proc.pid):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)

def _log_tail(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else "no output"

@dataclass(frozen=True)
class BuildRequest:
    """One wheel build as typed data (cibuildwheel's BuildOptions): made once by the CLI, read by every stage,
    so that a new option is one field and not a parameter threaded through three signatures.

    Sharded builds (wheels/shards.py): `plan_only` lists the compile units, `shard=(i, n)` compiles shard i's
    units into the object store `objects`, `link_only` gathers every unit from that store and links."""

    spec: BuildSpec
    out: Path
    python: str = sys.executable
    build_dir: Path | None = None  # default: the cache's build/<cell>/<package>
    toolkit: str = "auto"
    jobs: int | None = None  # default: sized from memory and cores (wheels/sizing.py)
    verify: bool = True
    shard: tuple[int, int] | None = None
    link_only: bool = False
    plan_only: bool = False
    objects: Path | None = None
    costs: tuple[Path, ...] = ()  # recorded per-unit compile times from earlier shards
    also: tuple[str, ...] = ()  # more Python interpreters the accepted wheel is verified in

    def __post_init__(self) -> None:
        modes = [n for n, on in (("--shard", self.shard is not None), ("--link-only", self.link_only),
                                 ("plan", self.plan_only)) if on]
        if len(modes) > 1:
            raise AttnkitError(f"{' and '.join(modes)}: a job either plans, compiles a shard or links them all")

    @property
    def mode(self) -> str | None:
        """None for a whole build; else the ninja shim's mode."""
        return "plan" if self.plan_only else "compile" if self.shard else "link" if self.link_only else None


def build_wheel(req: BuildRequest) -> BuildReport:
    """Build, accept and report one wheel (or plan, compile or link a sharded one: BuildRequest.mode)."""
    spec, python, shard, objects = req.spec, req.python, req.shard, req.objects
    cell = spec.cell
    assert cell.cuda is not None
    env_info = pyenv.describe(python)
    bad = pyenv.cell_mismatches(env_info, cell)
    if bad:
        raise AttnkitError(f"--python {python}: does not match cell {cell.id}: {'; '.join(bad)}")
    cache = cache_dir()
    tk = resolve_toolkit(req.toolkit, cell.cuda, spec.toolkit_pypi, cache / "toolkits", python)
    check_major(tk, env_info.torch_cuda or cell.cuda, f"torch {env_info.torch}")
    build_dir = req.build_dir or (cache / "build" / cell.id / spec.package)
    build_dir.mkdir(parents=True, exist_ok=True)
    knobs = spec.recipe.build
    n_jobs, why = jobs_for(spec, req.jobs)
    report = BuildReport(spec.package, spec.version, cell.id, jobs=n_jobs, jobs_reason=why,
                         nvcc_threads=knobs.nvcc_threads, archs=format_archs(list(spec.archs), knobs.arch_format),
                         toolkit=f"CUDA {tk.version} ({tk.source}: {tk.home})", log=str(build_dir / "build.log"))
    mode = req.mode
    what = {"plan": "planning", "compile": f"compiling shard {shard[0]}/{shard[1]} of" if shard else "",
            "link": "linking", None: "building"}[mode]
    print(f"attnkit: {what} {spec.package} {spec.version} for {cell.id}: {knobs.arch_env}={report.archs}, "
          f"{n_jobs} jobs ({why}), toolkit {report.toolkit}", file=sys.stderr, flush=True)
    src = prepare_source(spec, build_dir, cache)
    report.patches = [pt.describe() for pt in spec.recipe.patches_for(cell.torch_version)]
    for line in report.patches:
        print(f"attnkit: source patch {line}", file=sys.stderr, flush=True)
    env = build_env(spec, tk, n_jobs)
    shim_report = build_dir / "shard-report.json"
    if mode is not None:
        env = _sharded_env(req, src, build_dir, env, tk, env_info.torch or "", shim_report)
    t0 = time.monotonic()
    built = run_build(spec, src, env, python, build_dir / "dist", build_dir / "build.log", report,
                      stopped=(lambda: _shim_stopped(shim_report)) if mode is not None else None)
    report.seconds = round(time.monotonic() - t0, 1)
    if mode is not None:
        report.shard = json.loads(shim_report.read_text(encoding="utf-8"))
        if mode == "link" and report.shard.get("missing"):
            raise AttnkitError(f"link: {len(report.shard['missing'])} of {report.shard['units']} objects are not in "
                               f"the object store {objects}: {', '.join(report.shard['missing'][:3])} ... (run every "
                               "shard of this cell with the same source, flags, toolkit and torch first)")
    if built is None:  # a plan or a shard: nothing to link
        return report
    final, verified = finalize(built, spec, req.out, python=python, machine=env_info.machine, verify=req.verify,
                               also=req.also)
    report.verify = verified or {}
    report.wheel = final.name
    # verification already hashed these exact bytes (accept copies them); hash again only when it did not run
    report.sha256 = str(verified["sha256"]) if verified else hashlib.sha256(final.read_bytes()).hexdigest()
    report.size_bytes = final.stat().st_size
    return report


def _shim_stopped(path: Path) -> bool:
    """The shim stopped the build on purpose: a plan or a shard done, or a link missing objects."""
    try:
        done = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return done.get("mode") in ("plan", "compile") or bool(done.get("missing"))


def _sharded_env(req: BuildRequest, src: Path, build_dir: Path, env: dict[str, str], tk: Toolkit, torch: str,
                 report: Path) -> dict[str, str]:
    """The build environment with attnkit's ninja shim first on PATH and its context written."""
    from attnkit.wheels import shards

    mode, spec, shard, objects = req.mode or "", req.spec, req.shard, req.objects

    real = shutil.which("ninja", path=env.get("PATH"))
    if real is None:
        raise AttnkitError("build: sharding needs ninja on PATH (pip install ninja), as torch's BuildExtension does")
    if mode in ("compile", "link") and objects is None:
        raise AttnkitError("--objects: a sharded build needs the object store folder (shared by its shard and "
                           "link jobs)")
    nvcc = subprocess.run([str(tk.home / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    report.unlink(missing_ok=True)
    ctx = shards.Context(mode=mode, real_ninja=real, source_root=str(src.resolve()),
                         build_root=str((src / "build").resolve()), store=str((objects or build_dir / "objects").resolve()),
                         report=str(report), source_digest=source_digest(spec),
                         toolkit=(nvcc.stdout.strip().splitlines() or [tk.version])[-1], torch=torch,
                         shard=shard[0] if shard else 0, shards=shard[1] if shard else 0,
                         patterns=dict(spec.recipe.build.unit_cost), recorded=shards.load_recorded(list(req.costs) or None))
    ctx_file = build_dir / "shard-context.json"
    ctx.write(ctx_file)
    shim_dir = shards.install_shim(build_dir / "shim").parent
    return {**env, "PATH": f"{shim_dir}{os.pathsep}{env.get('PATH', '')}", shards.ENV_CONTEXT: str(ctx_file)}


def report_dict(r: BuildReport) -> dict[str, Any]:
    return asdict(r)
