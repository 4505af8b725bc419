"""Issue 14: one flash-attn compile unit's own nvcc command (from its build.ninja), run for sm_90 alone and for
80;90;100;120 with --threads 4, to check how a unit's CPU time and wall time scale with the arch count (the
projection in docs/results/<date>-h200-sharded-build.json assumes CPU time x archs).
Usage: python3 tools/h200_unit_archs.py BUILD_TREE UNIT_SOURCE_NAME OUT_JSON [THREADS, default 4]
(THREADS: nvcc --threads for the 4-arch compile; the machine's core count is the useful value)"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

FOUR = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        "-gencode", "arch=compute_100,code=sm_100", "-gencode", "arch=compute_120,code=sm_120"]


def variant(argv: list[str], out: str, archs: list[str] | None, threads: str) -> list[str]:
    """The same command writing to `out`, with --threads `threads` and, given `archs`, those -gencode flags in
    place of sm_90's (flash-attn writes `-gencode arch=...`, torch's own arch list `-gencode=arch=...`)."""
    res, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "-gencode" or a.startswith("-gencode="):
            flag = argv[i + 1] if a == "-gencode" else a.split("=", 1)[1]
            if archs is not None and "sm_90" in flag:
                res += archs
            elif archs is None:
                res += argv[i:i + 2] if a == "-gencode" else [a]
            i += 2 if a == "-gencode" else 1
            continue
        if a in ("-o", "--dependency-output", "-MF", "--threads"):
            res += [a, out if a == "-o" else out + ".d" if a != "--threads" else threads]
            i += 2
            continue
        res.append(a)
        i += 1
    return res if "--threads" in res else [*res, "--threads", threads]


def timed(argv: list[str], cwd: str) -> dict[str, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"compile failed: {' '.join(argv)[:300]}")
    return {"wall_s": round(time.monotonic() - t0, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}


def cubins(path: str) -> list[str] | None:
    tool = shutil.which("cuobjdump") or shutil.which("cuobjdump", path="/usr/local/cuda/bin")
    if tool is None:
        return None
    listing = subprocess.run([tool, "--list-elf", path], capture_output=True, text=True).stdout
    return sorted({w.split(".")[-2] for w in listing.split() if w.endswith(".cubin")})


def main() -> None:
    tree, unit, out_json = sys.argv[1:4]
    threads = sys.argv[4] if len(sys.argv) > 4 else "4"
    commands = subprocess.run(["ninja", "-t", "commands", "-s"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.splitlines()
    line = next(c for c in commands if f"/{unit}" in c and "nvcc" in c)
    argv = shlex.split(line)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    report: dict[str, object] = {"unit": unit, "cpus": len(os.sched_getaffinity(0)), "cpu_model": model,
                                 "date": time.strftime("%Y-%m-%d")}
    four_name = f"sm80_90_100_120_threads{threads}"
    for name, archs, n in (("sm90_threads1", None, "1"), (four_name, FOUR, threads)):
        obj = f"/tmp/{name}.o"
        report[name] = {**timed(variant(argv, obj, archs, n), tree), "cubins": cubins(obj)}
        print(name, report[name], flush=True)
    one, four = report["sm90_threads1"], report[four_name]
    report["cpu_ratio"] = round(four["cpu_s"] / one["cpu_s"], 2)  # type: ignore[index]
    report["wall_ratio"] = round(four["wall_s"] / one["wall_s"], 2)  # type: ignore[index]
    report["command_sm90"] = line
    tmp = out_json + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, out_json)


if __name__ == "__main__":
    main()
