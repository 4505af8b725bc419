"""Pipeline stage 2, job sizing: how many compile jobs this machine can run, from its cores AND its memory
(a heavy nvcc job takes several GB). Memory is the cgroup's limit when the build runs in one (containers,
CI runners, Kubernetes pods: /proc/meminfo shows the host there), else /proc/meminfo."""

from __future__ import annotations

import os
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.wheels.recipe import BuildSpec

CGROUP = Path("/sys/fs/cgroup")


def _meminfo_gib() -> dict[str, float]:
    """/proc/meminfo's MemTotal and MemAvailable in GiB, read now ({} where there is none)."""
    try:
        return {ln.split(":")[0]: int(ln.split()[1]) / (1024 * 1024)
                for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith(("MemTotal:", "MemAvailable:"))}
    except (OSError, ValueError, IndexError):
        return {}


def cgroup_available_gib(root: Path = CGROUP) -> float | None:
    """Memory this cgroup may still use, in GiB (limit - usage): cgroup v2 (memory.max, memory.current) or
    v1 (memory/memory.limit_in_bytes, memory/memory.usage_in_bytes); None when there is no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit_file).read_text().strip()
        except OSError:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        try:
            used = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            used = 0
        return max(0.0, (int(raw) - used) / (1 << 30))
    return None


def available_memory_gib(root: Path = CGROUP) -> float:
    """The smaller of /proc/meminfo's MemAvailable and what the cgroup still allows."""
    free = _meminfo_gib().get("MemAvailable", 8.0)
    limit = cgroup_available_gib(root)
    return free if limit is None else min(free, limit)


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

def jobs_for(spec: BuildSpec, override: int | None = None) -> tuple[int, str]:
    """choose_jobs() for this machine and this recipe's per-job cost."""
    knobs = spec.recipe.build
    return choose_jobs(cpu_count(), available_memory_gib(), knobs.nvcc_threads, knobs.memory_per_job_gib, override)

def memory_used_gib() -> float | None:
    """MemTotal - MemAvailable, both read now: on VMs whose memory grows as it is used (Firecracker
    balloons), a MemTotal read once at the start would understate the peak."""
    info = _meminfo_gib()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    return info["MemTotal"] - info["MemAvailable"]
