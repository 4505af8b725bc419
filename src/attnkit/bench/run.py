"""`attnkit bench`: one shape's race (both timing modes, forward and fwd+bwd, numerics checked), the suite,
the ratios against the oracle and the plain call, the dispatch overhead, and the report."""

from __future__ import annotations

import datetime as _dt
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from attnkit._io import write_atomic
from attnkit.bench.candidates import AUTO, JIT_WARM_CALLS, PLAIN, Case, compiles
from attnkit.bench.numerics import BENCH_TOL, max_error
from attnkit.bench.shapes import Shape, attn_flops, named, suite
from attnkit.bench.timer import b2b_calls, interleaved, sync, sync_iters, warm, warm_gpu
from attnkit.errors import UsageError, first_line
from attnkit.runtime import table

TARGET_ORACLE = 0.97
TARGET_PLAIN = 0.98


def bench_shape(s: Shape, device: str, iters: int = 15, rounds: int = 5, backends_only: bool = False,
                prune: float = 0.0, confirm: int = 0) -> dict[str, Any]:
    """One shape raced in both timing modes, forward and (train) fwd+bwd, every output checked. `backends_only`:
    only attention() forced to each backend (the tune sweep: a table ranks backends, nothing else). `prune` (the
    sweep's): a candidate more than `prune` times slower than the fastest in the first two timed calls is not
    timed further; that time stands for both modes (marked "pruned"): it ranks last either way, and on large calls
    the slow candidates took most of a case's time. `confirm` (validate's): per mode, attention() and the race's
    fastest other candidate timed again head to head with `confirm` times the samples ("confirmed"): the race's
    minimum over many noisy timings is biased low (the fastest of 15 candidates that run one kernel looks faster
    than that kernel), a second race of two on fresh samples is not."""
    import torch

    from attnkit.runtime.backends.flex import for_measurement
    from attnkit.runtime.priority import order_for
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import select

    for_measurement()

    c = Case(s, device)
    p = probe()
    out: dict[str, Any] = {"label": s.label, "shape": asdict(s), "ms": {}, "errors": {}, "absent": {},
                           "max_err": {}, "wrong": {}, "selected_by_pass": {}, "row": {}}
    passes = ["fwd", "fwdbwd"] if s.train else ["fwd"]
    for ps in passes:
        grad = ps == "fwdbwd"
        call = c.call(grad)
        if ps == passes[-1]:
            out["call"] = call.describe()
        chosen = select(call, p).name
        row = order_for(call, p.capability(call.device_index) if device == "cuda" else None)[1]
        out["selected_by_pass"][ps] = chosen
        out.setdefault("cell", {})[ps] = table.cell_of(call)
        out["row"][ps] = row.describe()
        runs, absent = c.candidates(grad, backends_only)
        out["absent"].update(absent)
        if grad:
            runs = {n: c.step(fn, n) for n, fn in runs.items()}
        steps: dict[str, float] = {}
        lap = _lap_timer(steps)
        with torch.set_grad_enabled(grad):
            # the sweep (prune) warms once: its two pruning calls follow, and every call of a large case counts
            warm_s: dict[str, float] = {}
            first, errors = warm(runs, device, times=1 if prune else 2, seconds=warm_s)
            if prune:  # a JIT backend's next calls are not steady yet either: FA4's replay runs a signature's
                # first call on FA4's own path, records it on the second and checks the record on the third
                # (fa4_replay). Judged on such calls, 28 of 190 FA4 forwards of the 2026-12-03 sweep were pruned
                # at 0.23-18 ms, and 24 of 69 fwd+bwd cases on 2026-12-04 at 2.5-31 ms (1 warm call too few)
                again = {n: fn for n, fn in runs.items() if n not in errors and compiles(n)}
                errors.update(warm(again, device, times=JIT_WARM_CALLS - 1, seconds=None)[1])
            lap("warm")
            out.setdefault("warm_seconds", {})[ps] = warm_s
            for n, err in errors.items():
                out["errors"][f"{n} {ps}"] = err
                runs.pop(n)
            if not grad:  # numerics: forward outputs against the reference
                tol = BENCH_TOL.get(s.dtype, 1e-3)
                for n, o in first.items():
                    e = max_error(c, o.detach(), n)
                    out["max_err"][n] = e
                    if not e <= tol:
                        out["wrong"][n] = f"forward max error {e:.3g} > {tol}"
            runs = {n: fn for n, fn in runs.items() if n not in out["wrong"]}
            lap("check")
            t_one = interleaved(runs, device, iters=2)
            fastest = min(t_one.values(), default=1e-6)
            calls, n_sync = b2b_calls(fastest), sync_iters(fastest, iters)
            slow = {n for n, t in t_one.items() if prune and t > prune * fastest}
            timed = {n: fn for n, fn in runs.items() if n not in slow}
            lap("first_calls")
            sync = interleaved(timed, device, iters=n_sync, seed=1)
            lap("sync")
            b2b = interleaved(timed, device, iters=rounds, calls=calls, seed=2)
            lap("b2b")
            if confirm and AUTO in timed:
                out.setdefault("confirmed", {})[ps] = _head_to_head(timed, device, {"sync": sync, "b2b": b2b},
                                                                    n_sync * confirm, rounds * confirm, calls)
                lap("confirm")
        # where a case's seconds go (the sweep's throughput decides how much of its plan a session measures)
        out.setdefault("step_seconds", {})[ps] = {k: round(v, 3) for k, v in steps.items()}
        for n in runs:
            if n in slow:
                out["ms"].setdefault(n, {})[ps] = {"sync": t_one[n] * 1e3, "b2b": t_one[n] * 1e3, "pruned": True}
            else:
                out["ms"].setdefault(n, {})[ps] = {"sync": sync[n] * 1e3, "b2b": b2b[n] * 1e3}
        out.setdefault("b2b_calls", {})[ps] = calls
        out.setdefault("sync_iters", {})[ps] = n_sync
    out["selected"] = out["selected_by_pass"][passes[-1]]
    out["jit_warmed"] = bool(prune)  # the sweep's JIT backends warmed before pruning (tune.cold_pruned)
    if prune:  # how often: tune.unsteady_pruned trusts a pruned JIT time only after JIT_WARM_CALLS
        out["jit_warm_calls"] = JIT_WARM_CALLS
    out["head_dim"] = s.head_dim
    out["log2_work"] = round(table.log2_work(call), 3)
    flops = attn_flops(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal)
    out["flops_fwd"] = flops
    out["fa4_or_varlen"] = s.lengths is not None or "flash_attn4" in out["ms"]
    out["ratios"] = ratios(out["ms"], passes)
    return out


def _head_to_head(runs: dict[str, Callable[[], Any]], device: str, race: dict[str, dict[str, float]], iters: int,
                  rounds: int, calls: int) -> dict[str, dict[str, Any]]:
    """Per mode: attention() against the race's fastest other candidate, two only, on new samples."""
    res: dict[str, dict[str, Any]] = {}
    for mode, t in race.items():
        rival = min((n for n in t if n != AUTO), key=lambda n: t[n], default=None)
        if rival is None:
            continue
        pair = {AUTO: runs[AUTO], rival: runs[rival]}
        again = (interleaved(pair, device, iters=iters, seed=3) if mode == "sync"
                 else interleaved(pair, device, iters=rounds, calls=calls, seed=4))
        res[mode] = {"against": rival, "selected_over_it": again[rival] / again[AUTO]}
    return res


def _lap_timer(into: dict[str, float]) -> Callable[[str], None]:
    """lap(name): the seconds since the previous lap (or since this was made) go into `into[name]`."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        into[name], last[0] = now - last[0], now
    return lap


def ratios(ms: dict[str, dict[str, dict[str, float]]], passes: list[str]) -> dict[str, Any]:
    """Per pass and mode: attnkit's speed relative to the oracle (fastest correct candidate) and to the plain
    SDPA call (>1 = attnkit faster)."""
    res: dict[str, Any] = {}
    for ps in passes:
        for mode in ("sync", "b2b"):
            t = {n: v[ps][mode] for n, v in ms.items() if ps in v}
            if AUTO not in t:
                continue
            oracle = min(t, key=lambda n: t[n])
            r: dict[str, Any] = {"oracle": oracle, "selected_over_oracle": t[oracle] / t[AUTO]}
            if PLAIN in t:
                r["selected_over_sdpa_plain"] = t[PLAIN] / t[AUTO]
            res.setdefault(ps, {})[mode] = r
    return res


# -- dispatch overhead -------------------------------------------------------------------------------------------

def dispatch_overhead(device: str, n: int = 2000) -> dict[str, Any]:
    """Host microseconds attention() adds per call over the plain SDPA call a user writes, on a tiny shape
    (so no kernel hides host time): blocks of back-to-back calls, alternated, median difference."""
    import torch
    import torch.nn.functional as F

    from attnkit.runtime import dispatch
    from attnkit.runtime.attention import attention

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 16, 2, 64, device=device, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)

    def loop(fn: Callable[[], Any], calls: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / calls * 1e6

    def plain() -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def via() -> Any:
        return attention(q, k, v, causal=True)

    with torch.no_grad():
        bound = dispatch.bind(q, k, v, causal=True)

        def via_bound() -> Any:  # attnkit.bind(): the call fixed once, no key built per call
            return bound(q, k, v)

        via()
        backend = next(b.backend.name for b in dispatch.bound_calls() if b.call.batch == q.shape[0]
                       and b.call.seqlen_q == q.shape[1] and b.call.heads == q.shape[2])
        loop(plain, 200)
        loop(via, 200)
        rounds = []
        block = max(50, n // 10)
        for i in range(21):  # short alternating blocks, order flipped each round; median difference
            if i % 2 == 0:
                a, b = loop(plain, block), loop(via, block)
            else:
                b, a = loop(via, block), loop(plain, block)
            rounds.append((b - a, a, b))
        bound_rounds = []
        for i in range(21):  # the same for the bound runner
            if i % 2 == 0:
                a, b = loop(plain, block), loop(via_bound, block)
            else:
                b, a = loop(via_bound, block), loop(plain, block)
            bound_rounds.append(b - a)
        # attention() alone: its cached runner swapped for a no-op (host cost of the lookup only)
        with dispatch.runners_replaced(lambda q, k, v: None):
            wrapper_us = min(loop(via, n) for _ in range(5))
    rounds.sort()
    mid = rounds[len(rounds) // 2]
    bound_rounds.sort()
    return {"backend": backend, "overhead_us": mid[0], "plain_us": mid[1], "attention_us": mid[2],
            "bound_overhead_us": bound_rounds[len(bound_rounds) // 2], "bound_backend": bound.backend.name,
            "wrapper_only_us": wrapper_us, "calls_per_block": block, "rounds": len(rounds)}


# -- the run ------------------------------------------------------------------------------------------------------


def measuring_device(what: str) -> str:
    """"cuda" when this machine's torch sees a GPU, else "cpu"; one line when torch is missing."""
    from attnkit.errors import UsageError
    from attnkit.runtime.probe import probe

    p = probe()
    if p.torch is None:
        raise UsageError(f"{what}: torch is not installed; run it in the environment whose kernels it should measure")
    return "cuda" if p.has_gpu and p.torch.cuda_available else "cpu"


def environment() -> dict[str, Any]:
    from attnkit.runtime.probe import probe

    p = probe()
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "probe": p.to_dict()}


def machine(env: dict[str, Any]) -> dict[str, Any]:
    """What makes two reports' times comparable: the GPUs, driver, torch and attention libraries they ran with."""
    p = env["probe"]
    return {"gpus": [g.get("name") for g in p.get("gpus") or []], "driver": p.get("driver"),
            "torch": (p.get("torch") or {}).get("version"),
            "libraries": {lib["name"]: lib.get("version") for lib in p.get("libraries") or [] if lib.get("installed")}}


def same_params(params: Any, s: Shape) -> bool:
    """A report row's recorded shape parameters are `s`'s as the code gives it now (JSON turns tuples into lists,
    so both sides go through it)."""
    return bool(json.loads(json.dumps(params, default=str)) == json.loads(json.dumps(asdict(s), default=str)))


def resumed_rows(path: Path, env: dict[str, Any], known: dict[str, Shape], *, what: str, bad: str,
                 row_ok: Callable[[dict[str, Any]], bool], label_key: str, params_key: str,
                 shape_set: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of an earlier report that a time limit cut short (`--resume`), and the dates of its sessions: only
    when it was measured on this machine (`machine`), every row passes `row_ok` and is one of `known` with the
    parameters it has now, none twice. Anything else is one line naming the file: one report's ratios come from
    one machine and one shape set."""
    where = f"--resume: {path}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows, earlier = data["shapes"], data["environment"]
        ok = isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r[label_key], str) and row_ok(r)
                                            for r in rows)
        mine, theirs = machine(env), machine(earlier)
        sessions = earlier.get("sessions", [earlier["date"]])
        ok = ok and isinstance(sessions, list) and all(isinstance(d, str) for d in sessions)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise UsageError(f"{where}: not an {what} report ({type(exc).__name__}: {first_line(exc, 80)})") from None
    if not ok:
        raise UsageError(f"{where}: not an {what} report ({bad}, or sessions that are not dates)")
    diff = next((k for k in ("gpus", "driver", "torch", "libraries") if mine[k] != theirs[k]), None)
    if diff is not None:
        raise UsageError(f"{where}: measured with {diff} {theirs[diff]}, this run has {mine[diff]}: one report's "
                         "ratios come from one machine; write a new --out")
    labels = [r[label_key] for r in rows]
    for r, label in zip(rows, labels, strict=True):
        if label not in known or not same_params(r.get(params_key), known[label]):
            raise UsageError(f"{where}: shape {label[:60]!r} is not one of {shape_set} with the parameters it has "
                             "now (a report of another set or attnkit version): write a new --out")
    if len(set(labels)) != len(labels):
        raise UsageError(f"{where}: a shape appears twice (not a report this command wrote)")
    return rows, sessions


def summarize(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """Minimums, the geometric mean over FA4/varlen shapes, and every shape below a target with its numbers."""
    summary: dict[str, Any] = {"targets": {"selected_over_oracle": TARGET_ORACLE,
                                           "selected_over_sdpa_plain": TARGET_PLAIN}}
    below: list[dict[str, Any]] = []
    for ps in ("fwd", "fwdbwd"):
        for mode in ("sync", "b2b"):
            rows = [(sh["label"], sh["ratios"][ps][mode]) for sh in shapes if ps in sh["ratios"]
                    and mode in sh["ratios"][ps]]
            if not rows:
                continue
            key = f"{ps}_{mode}"
            oracle = [r["selected_over_oracle"] for _, r in rows]
            plain = [r["selected_over_sdpa_plain"] for _, r in rows if "selected_over_sdpa_plain" in r]
            fa4 = [sh["ratios"][ps][mode]["selected_over_sdpa_plain"] for sh in shapes
                   if sh["fa4_or_varlen"] and ps in sh["ratios"] and "selected_over_sdpa_plain" in sh["ratios"][ps].get(mode, {})]
            summary[key] = {"min_selected_over_oracle": min(oracle),
                            "min_selected_over_sdpa_plain": min(plain) if plain else None,
                            "geomean_selected_over_sdpa_plain_fa4_or_varlen":
                                math.exp(statistics.fmean(math.log(x) for x in fa4)) if fa4 else None,
                            "shapes": len(rows)}
            for label, r in rows:
                if r["selected_over_oracle"] < TARGET_ORACLE or r.get("selected_over_sdpa_plain", 9) < TARGET_PLAIN:
                    below.append({"shape": label, "pass": ps, "mode": mode, **r})
    summary["below_target"] = below
    return summary


def bench_resumed(out: Path, env: dict[str, Any], shapes: list[Shape]) -> tuple[list[dict[str, Any]], list[str]]:
    """An earlier `attnkit bench --out` report cut by a time limit: its shapes, kept (resumed_rows' checks)."""
    return resumed_rows(
        out, env, {s.label: s for s in shapes}, what="`attnkit bench --out`",
        bad="a shape without its times and ratios",
        row_ok=lambda r: isinstance(r["ms"], dict) and isinstance(r["ratios"], dict) and isinstance(r["shape"], dict),
        label_key="label", params_key="shape", shape_set="this run's bench shapes")


def run_bench(out: str | None = None, quick: bool = False, png: bool = True, only: list[str] | None = None,
              resume: bool = False) -> int:
    """`resume`: `out` is an earlier run's report, cut short (a device's time limit): its shapes are kept (all of
    them, `only` or not), the suite's others that `only` names timed and added (2026-12-06: 22 of the 28 shapes
    took a 600 s phase on an H100). Each row keeps its own sampling (`b2b_calls`, `sync_iters`); `dispatch` is this
    run's, the earlier sessions' dates are in environment.sessions. A missing `out` starts a new report (said)."""
    from rich.console import Console
    from rich.table import Table

    from attnkit.errors import AttnkitError
    from attnkit.runtime.probe import probe

    p = probe()
    if p.torch is None:
        raise AttnkitError("bench: torch is not installed; install the torch of your matrix cell first")
    device = "cuda" if p.has_gpu and p.torch.cuda_available else "cpu"
    quick = quick or device == "cpu"
    shapes = suite(quick)
    shapes_to_run = named(shapes, only)
    con = Console(width=200)
    env = environment()
    results: list[dict[str, Any]] = []
    if resume and out and Path(out).exists():  # read and checked before anything is timed
        earlier, sessions = bench_resumed(Path(out), env, shapes)
        env = {**env, "sessions": [*sessions, env["date"]]}  # the report's date is its latest session's
        done = {r["label"] for r in earlier}
        results.extend(earlier)
        shapes_to_run = [s for s in shapes_to_run if s.label not in done]
        con.print(f"bench: {len(done)} shapes kept from {out}, {len(shapes_to_run)} to time")
    elif resume:
        con.print(f"bench: --resume: {out} does not exist yet: a new report")
    if device == "cuda":
        warm_gpu()
    # host-side overhead first, before the big shapes leave the process with a large heap; 3 repeats (the
    # median one is reported) because the host's state moves a 50 us call by tens of percent
    repeats = sorted((dispatch_overhead(device, n=200 if quick else 2000) for _ in range(3)),
                     key=lambda r: r["overhead_us"])
    dispatch = {**repeats[1], "repeats_us": [round(r["overhead_us"], 3) for r in repeats]}
    report: dict[str, Any] = {"environment": env, "device": device, "quick": quick, "shapes": results,
                              "dispatch": dispatch}
    order = {s.label: i for i, s in enumerate(shapes)}
    for s in shapes_to_run:
        t0 = time.perf_counter()
        results.append(bench_shape(s, device, iters=5 if quick else 12, rounds=3 if quick else 4))
        results.sort(key=lambda r: order.get(r["label"], len(order)))  # suite order, resumed shapes among them
        con.print(f"bench {s.label}: {time.perf_counter() - t0:.1f} s")
        if out:  # the report so far: a run cut short by a time limit still leaves every finished shape
            write_atomic(Path(out), json.dumps({**report, "partial": True}, indent=1, default=str))
    report["summary"] = {**summarize(results), "dispatch_overhead_us": dispatch["overhead_us"],
                         "dispatch_wrapper_only_us": dispatch["wrapper_only_us"],
                         "bound_overhead_us": dispatch["bound_overhead_us"]}
    t = Table(title=f"attnkit bench on {device}: speed vs the plain SDPA call and vs the oracle (>=1: attnkit as fast)")
    for col in ("shape", "pass", "selected", "row", "oracle sync", "sel/oracle sync", "sel/oracle b2b",
                "sel/plain sync", "sel/plain b2b"):
        t.add_column(col)
    for r in results:
        for ps, modes in r["ratios"].items():
            sy, bb = modes.get("sync", {}), modes.get("b2b", {})
            t.add_row(r["label"], ps, r["selected_by_pass"][ps], r["row"][ps], str(sy.get("oracle")),
                      *(f"{m.get(k, 0):.3f}" for m, k in ((sy, "selected_over_oracle"), (bb, "selected_over_oracle"),
                                                            (sy, "selected_over_sdpa_plain"),
                                                            (bb, "selected_over_sdpa_plain"))))
    con.print(t)
    con.print(f"summary: {json.dumps({k: v for k, v in report['summary'].items() if k != 'below_target'})}")
    for b in report["summary"]["below_target"]:
        con.print(f"below target: {b}")
    if out:
        path = Path(out)
        write_atomic(path, json.dumps(report, indent=1, default=str))
        con.print(f"wrote {path}")
        if png:
            try:
                from attnkit.bench.plot import chart

                chart(report, path.with_suffix(".png"))
                con.print(f"wrote {path.with_suffix('.png')}")
            except ImportError:
                con.print("matplotlib not installed: no chart")
    return 0
