"""The build driver: one package for one cell, natively, with the cell's torch and a matching CUDA toolkit.

- parallelism from cores AND memory (a heavy nvcc job takes several GB), overridable;
- resumable: the source tree and its build/ folder live in a persistent build dir, and setuptools' ninja
  build only recompiles objects that are missing or stale, so a build stopped by a time limit continues;
- progress from ninja's `[done/total]` lines (objects done, elapsed, estimate), and a full log kept;
- the wheel is renamed/pinned (retag) and verified before it is moved into the output directory.
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
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnkit._io import cache_dir
from attnkit._progress import Counter, download
from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.wheels import pyenv
from attnkit.wheels.recipe import BuildSpec, format_archs
from attnkit.wheels.toolkit import Toolkit, check_major, resolve_toolkit

_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def _meminfo_gib() -> dict[str, float]:
    """/proc/meminfo's MemTotal and MemAvailable in GiB, read now ({} where there is none)."""
    try:
        return {ln.split(":")[0]: int(ln.split()[1]) / (1024 * 1024)
                for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith(("MemTotal:", "MemAvailable:"))}
    except (OSError, ValueError, IndexError):
        return {}


def available_memory_gib() -> float:
    return _meminfo_gib().get("MemAvailable", 8.0)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def choose_jobs(cores: int, mem_gib: float, nvcc_threads: int, mem_per_job_gib: float,
                override: int | None = None) -> tuple[int, str]:
    """Parallel compile jobs, and why: limited by cores (each job runs `nvcc_threads` threads) and by
    memory (each job may peak at `mem_per_job_gib`), so a build never runs the machine out of memory."""
    if override is not None:
        if override < 1:
            raise AttnkitError(f"--jobs: must be >= 1, got {override}")
        return override, "set by --jobs"
    by_cores = max(1, cores // nvcc_threads)
    by_mem = max(1, int(mem_gib // mem_per_job_gib))
    jobs = min(by_cores, by_mem)
    limit = "memory" if by_mem < by_cores else "cores"
    return jobs, (f"{cores} cores / {nvcc_threads} nvcc threads = {by_cores}, {mem_gib:.0f} GiB free / "
                  f"{mem_per_job_gib:g} GiB per job = {by_mem}: limited by {limit}")


def fetch_sdist(url: str, sha256: str, cache: Path) -> Path:
    """Download once into the cache; a file whose sha256 differs from matrix.yaml's is refused."""
    dest = cache / "sdists" / url.rsplit("/", 1)[-1]
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == sha256:
        return dest
    got_path = download(url, dest.with_name(dest.name + ".new"), f"sdist {dest.name}")
    got = hashlib.sha256(got_path.read_bytes()).hexdigest()
    if got != sha256:
        got_path.unlink(missing_ok=True)
        raise AttnkitError(f"sdist: {url} has sha256 {got}, matrix.yaml says {sha256}")
    got_path.replace(dest)
    return dest


def prepare_source(spec: BuildSpec, build_dir: Path, cache: Path) -> Path:
    """The source tree to build in. Kept between runs (with its build/ objects) so builds resume."""
    src = build_dir / "src"
    if spec.local_source is not None:
        # copy2 keeps the sources' mtimes, so ninja still sees earlier objects as up to date
        shutil.copytree(spec.local_source, src, dirs_exist_ok=True, copy_function=shutil.copy2,
                        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
        return src
    assert spec.sdist_url and spec.sdist_sha256
    marker = build_dir / ".sdist-sha256"
    if src.is_dir() and marker.is_file() and marker.read_text().strip() == spec.sdist_sha256:
        return src
    archive = fetch_sdist(spec.sdist_url, spec.sdist_sha256, cache)
    tmp = build_dir / "src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    tops = [p for p in tmp.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise AttnkitError(f"sdist: {archive.name} does not unpack to one folder")
    shutil.rmtree(src, ignore_errors=True)
    tops[0].replace(src)
    shutil.rmtree(tmp, ignore_errors=True)
    marker.write_text(spec.sdist_sha256 + "\n")
    return src


def jobs_for(spec: BuildSpec, override: int | None = None) -> tuple[int, str]:
    """choose_jobs() for this machine and this recipe's per-job cost."""
    knobs = spec.recipe.build
    return choose_jobs(cpu_count(), available_memory_gib(), knobs.nvcc_threads, knobs.memory_per_job_gib, override)


def recipe_env(spec: BuildSpec, jobs: int) -> dict[str, str]:
    """The variables that drive the package's setup.py: the recipe's switches, its arch list, parallelism.
    Shared by the native build and `attnkit wheels env` (CI, cibuildwheel)."""
    knobs = spec.recipe.build
    env = dict(knobs.env)
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
    verify: dict[str, Any] = field(default_factory=dict)


def memory_used_gib() -> float | None:
    """MemTotal - MemAvailable, both read now: on VMs whose memory grows as it is used (Firecracker
    balloons), a MemTotal read once at the start would understate the peak."""
    info = _meminfo_gib()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    return info["MemTotal"] - info["MemAvailable"]


def _watch_memory(stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(1.0):
        used = memory_used_gib()
        if used is None:
            return
        out.append(used)


def run_build(spec: BuildSpec, src: Path, env: dict[str, str], python: str, dist: Path, log_path: Path,
              report: BuildReport) -> Path:
    """Run `pip wheel` in the source tree (in place, so objects persist), streaming progress."""
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


def build_wheel(spec: BuildSpec, out: Path, *, python: str = sys.executable, build_dir: Path | None = None,
                toolkit: str = "auto", jobs: int | None = None, verify: bool = True) -> BuildReport:
    cell = spec.cell
    assert cell.cuda is not None
    env_info = pyenv.describe(python)
    bad = pyenv.cell_mismatches(env_info, cell)
    if bad:
        raise AttnkitError(f"--python {python}: does not match cell {cell.id}: {'; '.join(bad)}")
    cache = cache_dir()
    tk = resolve_toolkit(toolkit, cell.cuda, spec.toolkit_pypi, cache / "toolkits", python)
    check_major(tk, env_info.torch_cuda or cell.cuda, f"torch {env_info.torch}")
    build_dir = build_dir or (cache / "build" / cell.id / spec.package)
    build_dir.mkdir(parents=True, exist_ok=True)
    knobs = spec.recipe.build
    n_jobs, why = jobs_for(spec, jobs)
    report = BuildReport(spec.package, spec.version, cell.id, jobs=n_jobs, jobs_reason=why,
                         nvcc_threads=knobs.nvcc_threads, archs=format_archs(list(spec.archs), knobs.arch_format),
                         toolkit=f"CUDA {tk.version} ({tk.source}: {tk.home})", log=str(build_dir / "build.log"))
    print(f"attnkit: building {spec.package} {spec.version} for {cell.id}: {knobs.arch_env}={report.archs}, "
          f"{n_jobs} jobs ({why}), toolkit {report.toolkit}", file=sys.stderr, flush=True)
    src = prepare_source(spec, build_dir, cache)
    t0 = time.monotonic()
    built = run_build(spec, src, build_env(spec, tk, n_jobs), python, build_dir / "dist",
                      build_dir / "build.log", report)
    report.seconds = round(time.monotonic() - t0, 1)
    final, verified = finalize(built, spec, out, python=python, machine=env_info.machine, verify=verify)
    report.verify = verified or {}
    report.wheel = final.name
    # verification already hashed these exact bytes (accept copies them); hash again only when it did not run
    report.sha256 = str(verified["sha256"]) if verified else hashlib.sha256(final.read_bytes()).hexdigest()
    report.size_bytes = final.stat().st_size
    return report


def finalize(built: Path, spec: BuildSpec, out: Path, *, python: str = sys.executable, machine: str | None = None,
             verify: bool = True) -> tuple[Path, dict[str, Any] | None]:
    """A freshly built wheel -> its published name and torch pin (retag) -> verified -> moved into `out`.
    Shared by the native driver and cibuildwheel's repair step, so both accept wheels the same way."""
    import platform
    import tempfile

    from attnkit.wheels.retag import retag

    cell = spec.cell
    assert cell.cuda is not None
    filename = naming.wheel_filename(spec.package, spec.version, cuda=cell.cuda, torch=cell.torch,
                                     cxx11_abi=cell.cxx11_abi, python=cell.python, wheel_tag=spec.wheel_tag, arch_subset=spec.arch_subset,
                                     machine=machine or platform.machine())
    with tempfile.TemporaryDirectory(prefix="attnkit-stage-") as tmp:
        staged = retag(built, Path(tmp), filename, cell.torch)
        if not verify:
            return accept(staged, out, None), None
        from attnkit.wheels.verify import verify_wheel

        vr = verify_wheel(staged, spec, python=python)
        if not vr.ok:
            raise AttnkitError(f"verify: {staged.name} rejected: {'; '.join(vr.problems)}")
        return accept(staged, out, vr.to_dict()), vr.to_dict()


def verification_path(wheel: Path) -> Path:
    """Where a wheel's verification report lives: next to it, `<wheel>.verify.json`."""
    return wheel.with_name(wheel.name + ".verify.json")


def accept(staged: Path, out: Path, verification: dict[str, Any] | None) -> Path:
    """Move a verified wheel into the output directory: temp name + rename, report first, so `out` never
    holds a half-written wheel or a wheel without its report."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / staged.name
    if verification is not None:
        from attnkit._io import write_atomic

        write_atomic(verification_path(final), json.dumps(verification, indent=1))
    tmp = out / f".{staged.name}.tmp"
    shutil.copyfile(staged, tmp)
    tmp.replace(final)
    return final


def report_dict(r: BuildReport) -> dict[str, Any]:
    return asdict(r)
