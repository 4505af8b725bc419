"""`attnkit smoke --distributed`: what a multi-GPU training node needs before anyone trains on it, checked by one
process per GPU started with torch's own launcher (`torch.distributed.run`):

- NCCL (gloo on the CPU) all-reduce, all-gather and broadcast, in bf16 and fp32, from 1 KB to 1 GB (a smaller cap on
  the CPU), each result checked;
- all-reduce bandwidth as nccl-tests defines it: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n;
- attention forward + backward on each rank's own GPU through attnkit's selection, against float64 (runtime/smoke.py);
- one DDP training step of a small model that calls attnkit.attention: its loss, and its parameters after the step,
  equal on every rank.

A failure names the rank, the device, the collective and the size in one line. A collective that does not return is
ended by the process group's timeout (and, should that not fire, by the launcher's), with a message naming the
collective that hung: every rank writes what it is about to do to its status file first. World size 1 (one GPU, or
the CPU with gloo) runs the same code, which is how CI tests it. Every process gets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off on lent machines).

`ATTNKIT_DIST_FAULT` (`wrong:RANK:COLLECTIVE` or `hang:RANK:COLLECTIVE`) makes one rank misbehave on purpose: the
gate's own test of itself, used by tests/test_distributed.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from attnkit._io import write_atomic
from attnkit.errors import first_line

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ENV_FAULT = "ATTNKIT_DIST_FAULT"
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
GPU_MAX_BYTES = 1 << 30
CPU_MAX_BYTES = 1 << 22  # gloo on 2 cores: 4 MiB keeps the CPU run in seconds


def sizes(max_bytes: int) -> list[int]:
    """1 KB, then x16 up to max_bytes (1 KB, 16 KB, 256 KB, 4 MB, 64 MB, 1 GB on a GPU)."""
    out, n = [], 1 << 10
    while n <= max_bytes:
        out.append(n)
        n <<= 4
    return out


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for an all-reduce of `nbytes` that took `seconds` (nccl-tests' definitions)."""
    alg = nbytes / seconds / 1e9
    return alg, alg * (2 * (world - 1) / world if world > 1 else 1.0)


# -- one rank ----------------------------------------------------------------------------------------------------

class CheckFailed(RuntimeError):
    """One rank's check failed: the message is the one line the launcher prints."""


def _fault() -> tuple[str, int, str] | None:
    spec = os.environ.get(ENV_FAULT, "")
    if not spec:
        return None
    kind, rank, what = spec.split(":")
    return kind, int(rank), what


def _worker(status_dir: Path, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    where = f"rank {rank} ({torch.cuda.get_device_name(local)}, {device})" if cuda else f"rank {rank} (cpu)"
    status = status_dir / f"rank-{rank}.status"
    fault = _fault()

    def doing(what: str) -> None:
        write_atomic(status, json.dumps({"rank": rank, "device": str(device), "doing": what, "t": time.time()}))

    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=timeout_s),
                            **({"device_id": device} if cuda else {}))
    out: dict[str, Any] = {"rank": rank, "world": world, "device": str(device), "where": where, "collectives": [],
                           "bandwidth": []}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for dtype in (torch.bfloat16, torch.float32):
        for nbytes in sizes(max_bytes):
            n = nbytes // torch.tensor([], dtype=dtype).element_size()
            for coll in COLLECTIVES:
                label = f"{coll} {str(dtype).removeprefix('torch.')} {nbytes} B"
                doing(label)
                if fault and fault[1] == rank and fault[2] == coll and fault[0] == "hang":
                    time.sleep(timeout_s * 3)  # never joins: the others wait in the collective until the timeout
                value = float(rank + 1)
                if fault and fault[1] == rank and fault[2] == coll and fault[0] == "wrong":
                    value = -7.0
                x = torch.full((n,), value, dtype=dtype, device=device)
                if coll == "all_reduce":
                    dist.all_reduce(x)
                    want = torch.full_like(x, world * (world + 1) / 2)
                    ok = torch.equal(x, want)
                    detail = f"got {x[0].item()} expected {want[0].item()}"
                elif coll == "all_gather":
                    parts = [torch.empty_like(x) for _ in range(world)]
                    dist.all_gather(parts, x)
                    bad = [r for r, p in enumerate(parts) if not torch.equal(p, torch.full_like(p, r + 1.0))]
                    ok, detail = not bad, f"the part of rank {bad[0] if bad else '-'} is wrong"
                else:
                    if rank != 0:
                        x.fill_(-1.0)
                    dist.broadcast(x, src=0)
                    ok = torch.equal(x, torch.full_like(x, 1.0))
                    detail = f"got {x[0].item()} expected 1.0 (rank 0's)"
                sync()
                if not ok:
                    raise CheckFailed(f"{where}: {label}: wrong result ({detail})")
                out["collectives"].append(label)
            if dtype == torch.bfloat16 or (nbytes < 1 << 20 and not cuda):
                continue
            doing(f"all_reduce bandwidth float32 {nbytes} B")
            x = torch.ones(nbytes // 4, device=device)
            reps = 5 if nbytes <= 1 << 26 else 3
            dist.all_reduce(x)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            sync()
            secs = (time.perf_counter() - t0) / reps
            alg, bus = bus_bandwidth(nbytes, secs, world)
            out["bandwidth"].append({"bytes": nbytes, "us": round(secs * 1e6, 1), "algbw_GBps": round(alg, 3),
                                     "busbw_GBps": round(bus, 3)})

    doing("attention forward + backward against float64")
    out["attention"] = _attention_check(device)
    if out["attention"]["outcome"] != "passed":
        raise CheckFailed(f"{where}: attention: {out['attention'].get('error') or out['attention'].get('reason')}")
    doing("DDP step")
    out["ddp"] = _ddp_step(device, world)
    doing("done")
    dist.destroy_process_group()
    return out


def _attention_check(device: Any) -> dict[str, Any]:
    from attnkit.runtime.smoke import AUTO, check

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return check(AUTO, "gqa", dtype, device.type if device.type == "cpu" else f"cuda:{device.index}")


def _ddp_step(device: Any, world: int) -> dict[str, Any]:
    """One step of a model with an attnkit attention layer under DDP: loss and parameters equal on every rank."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from attnkit.runtime.attention import attention

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(64, 3 * 64)
            self.out = torch.nn.Linear(64, 64)

        def forward(self, x: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 16).unbind(2)
            return self.out(attention(q, k, v, causal=True).reshape(b, s, 64))

    torch.manual_seed(0)  # the same weights and data on every rank: the loss must agree exactly
    model = Block().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(2, 32, 64, device=device)
    loss = ddp(x).square().mean()
    loss.backward()
    opt.step()
    losses = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(losses, loss.detach().reshape(1))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    low = flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    values = [v.item() for v in losses]
    diff = (spread - low).abs().max().item()
    if len(set(values)) != 1 or diff != 0.0:
        raise CheckFailed(f"rank {dist.get_rank()} ({device}): DDP step: losses {values}, parameters differ by {diff}")
    return {"loss": values[0], "losses_equal": True, "params_max_spread": diff}


def worker_main(argv: list[str]) -> int:
    """One rank (started by torch.distributed.run): writes rank-<r>.json, or rank-<r>.error with one line."""
    status_dir, max_bytes, timeout_s = Path(argv[0]), int(argv[1]), float(argv[2])
    rank = int(os.environ.get("RANK", 0))
    try:
        res = _worker(status_dir, max_bytes, timeout_s)
    except Exception as exc:
        msg = str(exc) if isinstance(exc, CheckFailed) else _named(status_dir, rank, exc)
        write_atomic(status_dir / f"rank-{rank}.error", msg)
        print(f"attnkit smoke --distributed: {msg}", file=sys.stderr)
        return 1
    write_atomic(status_dir / f"rank-{rank}.json", json.dumps(res))
    return 0


def _named(status_dir: Path, rank: int, exc: BaseException) -> str:
    """An exception during a collective as one line: the rank, its device, and what it was doing."""
    try:
        st = json.loads((status_dir / f"rank-{rank}.status").read_text())
    except (OSError, ValueError):
        st = {"device": "?", "doing": "starting"}
    first = first_line(exc, 200)
    hung = "timeout" in first.lower() or "timed out" in first.lower()
    what = "did not complete (hung: the process group's timeout ended it)" if hung else f"failed: {type(exc).__name__}: {first}"
    return f"rank {rank} ({st['device']}): {st['doing']}: {what}"


# -- the launcher -------------------------------------------------------------------------------------------------

def visible_gpus() -> int:
    from attnkit.runtime.probe import probe

    p = probe()
    return len(p.gpus) if p.torch is not None and p.torch.cuda_available else 0


def topology() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def run_distributed(nproc: int | None = None, timeout_s: float = 120.0, max_bytes: int | None = None,
                    report: str | None = None, say: Any = print) -> int:
    """Start one rank per GPU (or `nproc` gloo ranks on the CPU), wait, and report; 0 when every check passed."""
    import tempfile

    gpus = visible_gpus()
    n = nproc or max(1, gpus)
    cap = max_bytes or (GPU_MAX_BYTES if gpus else CPU_MAX_BYTES)
    status_dir = Path(tempfile.mkdtemp(prefix="attnkit-dist-"))
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "attnkit.runtime.distributed", str(status_dir), str(cap), str(timeout_s)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s * 2 + 120)  # the launcher's own bound, past the group's
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        code = -9
    seconds = round(time.perf_counter() - t0, 1)
    ranks = [json.loads((status_dir / f"rank-{r}.json").read_text()) for r in range(n)
             if (status_dir / f"rank-{r}.json").exists()]
    errors = [(status_dir / f"rank-{r}.error").read_text() for r in range(n) if (status_dir / f"rank-{r}.error").exists()]
    if code == -9 and not errors:  # nothing fired inside: name what each silent rank was doing
        for r in range(n):
            try:
                st = json.loads((status_dir / f"rank-{r}.status").read_text())
                errors.append(f"rank {r} ({st['device']}): {st['doing']}: did not complete within the launcher's "
                              f"{timeout_s * 2 + 120:.0f} s (hung)")
            except (OSError, ValueError):
                errors.append(f"rank {r}: never started")
    ok = code == 0 and len(ranks) == n and not errors
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "world_size": n,
                           "gpus_visible": gpus, "backend": "nccl" if gpus else "gloo", "seconds": seconds,
                           "passed": ok, "errors": errors, "topology": topology() if gpus else None,
                           "bandwidth": ranks[0]["bandwidth"] if ranks else [], "ranks": ranks,
                           "env": SAFE_ENV, "launcher_exit": code}
    if not ok and not errors:
        errors.append(f"torch.distributed.run exited {code}: {log.strip().splitlines()[-1] if log.strip() else ''}")
    for e in errors:
        say(f"FAILED {e}")
    if ok:
        say(f"distributed smoke: {n} ranks ({doc['backend']}) passed in {seconds} s: "
            f"{len(ranks[0]['collectives'])} collectives checked per rank, attention and a DDP step on every rank; "
            + ", ".join(f"{b['bytes'] >> 10} KiB busbw {b['busbw_GBps']} GB/s" for b in doc["bandwidth"]))
    if report:
        write_atomic(Path(report), json.dumps(doc, indent=1))
        say(f"wrote {report}")
    shutil.rmtree(status_dir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
