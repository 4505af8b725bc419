"""`attnkit doctor`, `bench`, `smoke`, `oracle`, `tune`, `warmup`: this machine's attention, checked and measured."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from attnkit._io import check_writable, write_atomic
from attnkit.cli._args import _positive_int, _seconds_arg, _shard_arg
from attnkit.errors import UsageError, first_line


def _cmd_doctor(a: argparse.Namespace) -> int:
    from attnkit.runtime.doctor import run_doctor

    return run_doctor(as_json=a.json)


def _cmd_bench(a: argparse.Namespace) -> int:
    if a.resume and (a.integrations or a.compiled):
        raise UsageError("--resume: continues the bench suite's report only (not --compiled or --integrations)")
    if a.resume and not a.out:
        raise UsageError("--resume: it needs --out (the earlier report to continue)")
    if a.integrations:  # the HF training step, kernels in a compiled graph, CUDA-graph decode: its own options
        from attnkit.bench.integrations import main as integrations

        if not a.out:
            raise UsageError("--out: required with --integrations (the JSON report)")
        check_writable(a.out, "--out")
        extra = [f"--{k}={getattr(a, k)}" for k in ("layers", "tokens", "batch", "iters", "replays")
                 if getattr(a, k) is not None]
        return integrations(["--out", a.out, *extra, *(f"--only={o}" for o in a.only or ())])
    if a.compiled:
        from attnkit.bench.compiled import run_compiled

        if not a.out:
            raise UsageError("--out: required with --compiled (the JSON report)")
        check_writable(a.out, "--out")
        return run_compiled(a.out, only=a.shape)
    from attnkit.bench.run import run_bench

    return run_bench(out=a.out, quick=a.quick, png=a.png, only=a.shape, resume=a.resume)


def _cmd_smoke(a: argparse.Namespace) -> int:
    if a.distributed:
        if a.backend or a.case:
            raise UsageError("--distributed: runs its own checks; --backend / --case are for the one-process smoke")
        from attnkit.runtime.distributed import run_distributed

        return run_distributed(nproc=a.nproc, timeout_s=a.timeout, max_bytes=a.max_bytes, report=a.report)
    from attnkit.runtime.smoke import run_smoke

    return run_smoke(report=a.report, backends=a.backend, cases=a.case)


def _cmd_oracle(a: argparse.Namespace) -> int:
    from attnkit.runtime.oracle import merge, run_oracle

    if a.merge:
        if a.resume:
            raise UsageError("--resume: runs the grid; --merge only joins reports (give the earlier ones to --merge)")
        return merge(a.merge, a.out)
    if not a.tests:
        raise UsageError("--tests: required (flash-attention's tests/test_flash_attn.py, or a checkout holding it); "
                         "or --merge REPORT... to join shard reports")
    if a.out:  # before the grid: a pass of minutes must not end by losing its report
        check_writable(a.out, "--out")
    return run_oracle(a.tests, out=a.out, budget=a.budget, shard=a.shard, backends=a.backend,
                      words=a.filter.split(",") if a.filter else None, forced_budget=a.forced_budget,
                      claims=a.claims, resume=a.resume)


def _refresh_arg(a: argparse.Namespace) -> tuple[str, list[Path] | None, str]:
    """(flag, files, kind) of the one --refresh-KIND given, else ("--refresh-fwd", None, "fwd"); two kinds, or a
    file that is not there, is one line."""
    from attnkit.bench import tune

    given = [(f"--refresh-{k}", files, k) for k in tune.REFRESH_KINDS if (files := getattr(a, f"refresh_{k}"))]
    if len(given) > 1:
        raise UsageError(f"{given[1][0]}: not with {given[0][0]} (one kind of refresh a run)")
    flag, files, kind = given[0] if given else ("--refresh-fwd", None, "fwd")
    missing = next((f for f in files or () if not Path(f).is_file()), None)
    if missing is not None:
        raise UsageError(f"{flag}: {missing}: no such file (give earlier `attnkit tune --out` files)")
    return flag, [Path(f) for f in files] if files else None, kind


def _cmd_tune(a: argparse.Namespace) -> int:
    from attnkit.bench import tune

    def other_mode(*flags: str) -> str | None:
        """The first of these tune modes given on the command line."""
        return next((f for f in flags if getattr(a, f[2:].replace("-", "_"))), None)

    refresh_flags = tuple(f"--refresh-{k}" for k in tune.REFRESH_KINDS)  # one flag a kind: --refresh-fwd ...

    if a.hide_cell and not a.cross_check:
        raise UsageError("--hide-cell: only with --cross-check (it changes what the leave-one-out hides)")
    if a.match is not None:
        other = other_mode("--merge", "--cross-check", "--rescore", "--refine")
        if other is not None:
            raise UsageError(f"--match: not with {other} (it picks among the plan's cases, a refresh's cases, or "
                             "the held-out shapes of --validate)")
        try:
            re.compile(a.match)
        except (re.error, OverflowError, RecursionError) as exc:
            raise UsageError(f"--match: {a.match[:80]!r} is not a regular expression ({first_line(exc, 80)})") from None
    if a.only_compiled:  # it chooses which of the timed run's cases run: meaningless elsewhere, and said so
        other = other_mode("--merge", "--validate", "--plan", "--cross-check", "--compile-only", "--refine",
                           "--rescore")
        if other is not None:
            raise UsageError(f"--only-compiled: not with {other} (it picks the timed run's cases from what "
                             "--compile-only compiled for the same --out, and that compiles the plan's or a "
                             "refresh's cases only)")
        if a.out and not tune.compiled_path(Path(a.out)).is_file():
            raise UsageError(f"--only-compiled: no {tune.compiled_path(Path(a.out))} (run `attnkit tune "
                             f"--compile-only --out {a.out} --resume` first)")
    if a.rescore:
        other = other_mode("--merge", "--validate", "--plan", "--compile-only", "--refine", "--resume", "--cross-check",
                           *refresh_flags, "--table")
        if other is not None:
            raise UsageError(f"--rescore: not with {other} (it reads a finished --validate report and runs nothing; "
                             "ATTNKIT_SELECTION_DIR chooses the table it decides from)")
        if not Path(a.rescore).is_file():
            raise UsageError(f"--rescore: {a.rescore}: no such file (give an `attnkit tune --validate --out` report)")
        if a.out:
            if Path(a.out).resolve() == Path(a.rescore).resolve():
                raise UsageError(f"--out: {a.out} is the --rescore input; the result goes to a new file")
            check_writable(a.out, "--out")
        rep = tune.rescore(Path(a.rescore))
        for r in rep["calls"]:
            print(f"{r['shape']} {r['pass']}: {r['pick']}{'' if r['same_pick'] else ' (the report picked another)'}"
                  f", sync {r['sync']}, b2b {r['b2b']}")
        print(f"summary: {json.dumps(rep['summary'])}; the report's pick {rep['same_picks']} of {rep['picks']}")
        if a.out:
            write_atomic(Path(a.out), json.dumps(rep, indent=1) + "\n")
            print(f"wrote {a.out}")
        return 0
    refresh_flag = other_mode(*refresh_flags)
    if refresh_flag is not None:  # those modes return before the refresh is read: said instead of ignored
        other = other_mode("--merge", "--cross-check", "--validate")
        if other is not None:
            raise UsageError(f"{refresh_flag}: not with {other} (a refresh times recorded cases again: a run of its "
                             "own, with --out, or listed by --plan)")
    if a.cross_check:
        other = other_mode("--merge", "--validate", "--plan", "--compile-only", "--refine", "--resume")
        if other is not None:
            raise UsageError(f"--cross-check: not with {other} (it reads finished result files and runs nothing)")
        missing = next((f for f in a.cross_check if not Path(f).is_file()), None)
        if missing is not None:
            raise UsageError(f"--cross-check: {missing}: no such file (give `attnkit tune --out` files)")
        if a.out:
            if any(Path(a.out).resolve() == Path(f).resolve() for f in a.cross_check):
                raise UsageError(f"--out: {a.out} is one of the --cross-check inputs; the report goes to a new file")
            check_writable(a.out, "--out")
        rep = tune.cross_check([Path(f) for f in a.cross_check], hide_cell=a.hide_cell)
        for name, r in rep["rules"].items():
            print(f"{name}: {json.dumps(r['summary'])}")
        if a.out:
            write_atomic(Path(a.out), json.dumps(rep, indent=1) + "\n")
            print(f"wrote {a.out}")
        return 0
    if not a.merge:  # the table's options alone would be ignored: said instead
        extra = next((f for f, v in (("--table", a.table), ("--png", a.png), ("--arch", a.arch)) if v), None)
        if extra is not None:
            raise UsageError(f"{extra}: only with --merge (it names the table --merge writes)")
    if a.merge:
        if not a.table:
            raise UsageError("--table: required with --merge (where <arch>.json goes, e.g. "
                             "src/attnkit/data/selection/sm90.json)")
        if any(Path(a.table).resolve() == Path(f).resolve() for f in a.merge):
            raise UsageError(f"--table: {a.table} is one of the --merge inputs; the table goes to a new file")
        check_writable(a.table, "--table")
        if a.png and a.png != "-":
            check_writable(a.png, "--png")
        if a.arch is not None and not re.fullmatch(r"sm[0-9]{2,3}|cpu", a.arch):
            raise UsageError(f"--arch: {a.arch!r} is not an architecture name (sm<major><minor>, e.g. sm90, or cpu)")
        table = tune.merge([Path(f) for f in a.merge], arch=a.arch)
        write_atomic(Path(a.table), json.dumps(table, indent=1) + "\n")
        print(f"wrote {a.table}: {len(table['cells'])} cells from {table['provenance']['cases']} cases")
        if a.png:
            png = Path(a.table).with_suffix(".png") if a.png == "-" else Path(a.png)
            try:
                tune.chart(table, png)
            except ImportError:  # an optional extra, as for `attnkit bench`: the table stands without its chart
                print(f"--png: matplotlib is not installed, so no {png} (pip install matplotlib)", file=sys.stderr)
                return 0
            print(f"wrote {png}")
        return 0
    if a.validate:
        if a.out:
            check_writable(a.out, "--out")
        if a.resume and not a.out:
            raise UsageError("--resume: with --validate it needs --out (the earlier report to continue)")
        if a.out and Path(a.out).exists() and not a.resume:
            raise UsageError(f"--out: {a.out} exists; pass --resume to continue it, or choose a new file")
        rep = tune.validate(Path(a.out) if a.out else None, quick=a.quick, resume=a.resume, match=a.match)
        print(json.dumps(rep["summary"], indent=1))
        return 0
    if a.plan:
        _, refresh, kind = _refresh_arg(a)
        if refresh:  # the cases that refresh would time (in its order), --match and --out applied as below
            cases = tune.refreshed(refresh, kind, a.match)
        else:
            cases = tune.matching(tune.plan(tune.QUICK if a.quick else tune.FEATURES), a.match)
        if a.match is not None and not cases and not refresh:
            raise UsageError(f"--match: {a.match!r} finds no planned case (labels look like "
                             "'bfloat16|True|gqa4|equal|-|short|D64|w27|train')")
        mine = cases[a.shard[0] - 1::a.shard[1]] if a.shard else cases
        if a.out and not Path(a.out).is_file():
            what = "is not a regular file" if Path(a.out).exists() else "no such file"
            raise UsageError(f"--out: {a.out}: {what} (with --plan, the `attnkit tune --out` file whose "
                             "measured cases are left out of the listing)")
        done = tune.measured([Path(a.out)]) if a.out else set()
        left = [s for s in mine if s.label not in done]
        for s in left:
            print(s.label)
        print(f"{len(left)} cases" + (f" ({len(mine) - len(left)} more measured in {a.out})" if a.out else ""),
              file=sys.stderr)
        return 0
    flag, refresh, kind = _refresh_arg(a)
    if refresh and a.refine:
        raise UsageError(f"{flag}: not with --refine (it times the given files' cases again, not new ones)")
    if a.compile_only:
        skip = Path(a.out) if a.out and a.resume else None  # --out --resume: the cases the timed run still has
        print(json.dumps(tune.compile_only(shard=a.shard or (1, 1), quick=a.quick, max_cases=a.max_cases,
                                           skip_done=skip, refresh=refresh, refresh_kind=kind,
                                           match=a.match)))
        return 0
    if not a.out:
        raise UsageError("--out: required (the JSON-lines file this shard's results are appended to)")
    missing = next((f for f in a.refine or () if not Path(f).is_file()), None)
    if missing is not None:
        raise UsageError(f"--refine: {missing}: no such file (give earlier `attnkit tune --out` files)")
    out = Path(a.out)
    if out.exists() and not a.resume:
        raise UsageError(f"--out: {out} exists; pass --resume to continue it, or choose a new file")
    res = tune.run(out, shard=a.shard or (1, 1), budget_s=a.budget, quick=a.quick,
                   refine_from=[Path(f) for f in a.refine] if a.refine else None, max_cases=a.max_cases,
                   only_compiled=a.only_compiled, refresh=refresh, refresh_kind=kind, match=a.match)
    print(json.dumps(res))
    return 0




def _cmd_warmup(a: argparse.Namespace) -> int:
    from attnkit.runtime.warmup import load_shapes, run_warmup, shapes_from_model

    if bool(a.shapes) == bool(a.model):
        raise UsageError("warmup: give --shapes FILE.json or --model CONFIG (config.json or its folder)")
    shapes = load_shapes(a.shapes) if a.shapes else shapes_from_model(a.model, a.seqlen, a.batch, a.dtype)
    return run_warmup(shapes, report=a.report, dry_run=a.dry_run, as_json=a.json)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this module's subcommands to `attnkit`'s parser."""
    dr = sub.add_parser("doctor", help="probe this machine and show which attention backends work")
    dr.add_argument("--json", action="store_true", help="print the report as JSON (exit 1 when unhealthy)")
    dr.set_defaults(func=_cmd_doctor)

    be = sub.add_parser("bench", help="benchmark every available backend against attnkit's choice")
    be.add_argument("--out", default=None, help="JSON report path (a PNG chart is written beside it)")
    be.add_argument("--quick", action="store_true", help="a small suite (CPU sanity runs)")
    be.add_argument("--no-png", dest="png", action="store_false", help="write no PNG chart beside the report")
    be.add_argument("--shape", action="append", help="only this shape of the suite (by label; repeatable)")
    be.add_argument("--resume", action="store_true", help="--out is an earlier run's report, cut short: keep its "
                    "shapes, time the suite's others (same GPU, driver, torch and libraries only)")
    be.add_argument("--compiled", action="store_true", help="instead: torch.compile(fullgraph=True) of attention() "
                    "against eager, per shape whose eager pick is FlashAttention-4 or flex (or --shape), on a GPU")
    be.add_argument("--integrations", action="store_true", help="instead: an HF training step, the kernels in a "
                    "compiled graph, CUDA-graph decode (GPU), with the options below")
    for opt, what in (("layers", "model layers (8)"), ("tokens", "sequence length (2048)"), ("batch", "batch (4)"),
                      ("iters", "timed steps (10)"), ("replays", "CUDA-graph replays (1000)")):
        be.add_argument(f"--{opt}", type=_positive_int, help=f"--integrations: {what}")
    be.add_argument("--only", action="append", choices=("cuda_graph_decode", "kernels_in_graph", "train_step"),
                    help="--integrations: only these parts (repeatable)")
    be.set_defaults(func=_cmd_bench)

    sm = sub.add_parser("smoke", help="check every backend's numerics, forward and backward, on this machine")
    sm.add_argument("--report", help="write the JSON report here")
    sm.add_argument("--backend", action="append", help="only this backend ('attnkit': attention() itself); repeatable")
    sm.add_argument("--case", action="append", help="only this case; repeatable")
    sm.add_argument("--distributed", action="store_true", help="one process per GPU (torch.distributed.run): NCCL "
                    "collectives checked and timed, attention on each GPU, a DDP step (gloo ranks on a CPU)")
    sm.add_argument("--nproc", type=_positive_int, help="--distributed: ranks (default: one per GPU, else 1)")
    sm.add_argument("--timeout", type=_seconds_arg, default=120.0, help="--distributed: seconds a collective may take "
                                                                         "before it counts as hung (120)")
    sm.add_argument("--max-bytes", type=_positive_int, help="--distributed: the largest collective (default 1 GiB on "
                                                            "GPUs, 4 MiB on the CPU)")
    sm.set_defaults(func=_cmd_smoke)

    orc = sub.add_parser("oracle", help="flash-attn's own test grid against attention() and every backend forced")
    orc.add_argument("--tests", help="flash-attention's tests/test_flash_attn.py (or a checkout holding it): the "
                                     "reference functions are read from it at run time")
    orc.add_argument("--out", help="write the JSON report here")
    orc.add_argument("--budget", type=_seconds_arg, default=600.0, help="stop starting cases after this many seconds")
    orc.add_argument("--forced-budget", type=_seconds_arg, help="after this many seconds, the rest of the cases run "
                     "attention()'s own pick only (the forced backends keep the sample done so far)")
    orc.add_argument("--shard", type=_shard_arg, help="I/N: run the I-th of N parts (split by kernel configuration)")
    orc.add_argument("--claims", metavar="DIR", help="instead of --shard: processes sharing DIR each run the kernel "
                     "configurations they claim first, so all stay busy until the grid is done (one DIR per pass)")
    orc.add_argument("--backend", action="append", help="only this backend ('attnkit': attention()'s pick); repeatable")
    orc.add_argument("--filter", help="keep cases whose tag holds every comma-separated word, e.g. varlen,alibi=True")
    orc.add_argument("--merge", nargs="+", metavar="REPORT", help="join shard reports into one (--out)")
    orc.add_argument("--resume", nargs="+", metavar="REPORT", help="leave out the cases these earlier reports "
                     "answered for every backend run now (a pass cut by its budget goes on; --merge joins them)")
    orc.set_defaults(func=_cmd_oracle)

    tu = sub.add_parser("tune", help="measure every backend over a grid of call features; write selection tables")
    tu.add_argument("--out", help="JSON-lines results of this shard (appended case by case; see --resume)")
    tu.add_argument("--resume", action="store_true", help="continue an existing --out file (skips its cases)")
    tu.add_argument("--shard", type=_shard_arg, help="I/N: run the I-th of N parts of the plan")
    tu.add_argument("--budget", type=_seconds_arg, default=1500.0, help="stop starting cases after this many seconds")
    tu.add_argument("--max-cases", type=_positive_int, help="run at most this many cases now")
    tu.add_argument("--quick", action="store_true", help="the small grid (a CPU run of the whole pipeline)")
    tu.add_argument("--refine", nargs="+", metavar="FILE", help="measure midpoints where these results' winners change")
    tu.add_argument("--refresh-fwd", nargs="+", metavar="FILE", help="time again the forward pass of these results' "
                    "cases that FlashAttention-4 ran (its forward replay changed it); --merge lets them replace it")
    tu.add_argument("--refresh-train", nargs="+", metavar="FILE", help="time again both passes of these results' "
                    "half-precision training cases near the cuDNN / FlashAttention-4 crossover (its training path "
                    "changed); --merge lets them replace the old ones")
    tu.add_argument("--refresh-varlen", nargs="+", metavar="FILE", help="time again every pass of these results' "
                    "packed cases that torch_varlen ran (its route changed); --merge lets them replace the old ones")
    tu.add_argument("--refresh-flex", nargs="+", metavar="FILE", help="time again every pass of these results' cases "
                    "of one length where flex was a contender, timed before each size got its own flex kernel; "
                    "--merge lets them replace the old ones")
    tu.add_argument("--plan", action="store_true", help="print the planned cases (of --shard) and their count; with "
                    "--out FILE, those FILE has not measured yet; with a --refresh-KIND, the cases it would time")
    tu.add_argument("--match", metavar="REGEX", help="only the plan's cases whose label REGEX finds (re.search; "
                    "e.g. '\\|short\\|' for the short packed cells; see --plan), with a --refresh-KIND only those of "
                    "its cases, or with --validate only those held-out shapes")
    tu.add_argument("--compile-only", action="store_true", help="run each case once, untimed, so JIT kernels are "
                                                               "compiled into their disk caches (shards side by side)")
    tu.add_argument("--only-compiled", action="store_true", help="time only the cases --compile-only finished for "
                    "this --out (no JIT compile inside the timed budget; the rest stay for --resume)")
    tu.add_argument("--merge", nargs="+", metavar="FILE", help="turn result files into a selection table (--table)")
    tu.add_argument("--table", help="with --merge: the table to write (e.g. src/attnkit/data/selection/sm90.json)")
    tu.add_argument("--arch", help="with --merge: the table's architecture name (default: from the results' GPU)")
    tu.add_argument("--png", nargs="?", const="-", help="with --merge: a PNG of the winner per point (default: "
                                                        "beside --table)")
    tu.add_argument("--cross-check", nargs="+", metavar="FILE", help="score the table lookup rule (and the variants "
                    "it was chosen from) leave-one-out on these results; --out writes the report")
    tu.add_argument("--hide-cell", action="store_true", help="with --cross-check: hide the held-out call's whole "
                    "cell too, so the neighbour cells decide (as for a call whose cell the sweep did not measure)")
    tu.add_argument("--validate", action="store_true", help="time held-out shapes (not grid points): attnkit against "
                                                           "the fastest correct candidate; --out writes the report")
    tu.add_argument("--rescore", metavar="REPORT", help="decide a --validate report's shapes again with the table and "
                    "rule as they are now, each pick timed by that report's measurements (no GPU); --out writes it")
    tu.set_defaults(func=_cmd_tune)

    wu = sub.add_parser("warmup", help="compile JIT kernels (FlashAttention-4) for a list of shapes ahead of time")
    wu.add_argument("--shapes", help="JSON list of shapes: heads, head_dim, seqlen | seqlen_q+seqlen_k | lengths, ...")
    wu.add_argument("--model", help="a Hugging Face config.json (or its folder): train, prefill and decode shapes")
    wu.add_argument("--seqlen", type=_positive_int, default=4096, help="with --model: sequence length (default 4096)")
    wu.add_argument("--batch", type=_positive_int, default=1, help="with --model: batch size (default 1)")
    wu.add_argument("--dtype", choices=("float16", "bfloat16"), help="with --model: override the config's dtype")
    wu.add_argument("--report", help="also write the JSON report here")
    wu.add_argument("--json", action="store_true", help="print the report as JSON")
    wu.add_argument("--dry-run", action="store_true", help="list the backend per shape; compile nothing")
    wu.set_defaults(func=_cmd_warmup)
