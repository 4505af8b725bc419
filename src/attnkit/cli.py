"""The `attnkit` command: parses arguments, calls the library, prints. Every error is one line on stderr
("attnkit: error: ..."), no traceback: exit status 2 for a usage error (the command line itself), 1 for a
failure (a bad file, a missing tool, a wheel that does not fit)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from attnkit._io import WriteError, write_atomic
from attnkit.errors import AttnkitError, UsageError, first_line, shown

FORMATS = ("table", "json", "github", "bake", "markdown")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _cmd_matrix(a: argparse.Namespace) -> int:
    from attnkit.matrix import CellFilter, emit, expand, load_matrix

    m = load_matrix(a.file)
    cells = expand(m, CellFilter(torch=a.torch, cuda=a.cuda, python=a.python, package=a.package))
    if a.format == "table":
        emit.print_table(m, cells)
    elif a.format == "json":
        print(emit.to_json(cells))
    elif a.format == "github":
        if a.shards and not a.package:
            raise UsageError("--shards: needs --package (shard jobs are per wheel)")
        print(emit.to_github(cells, a.package, shards=a.shards))
    elif a.format == "bake":
        print(emit.to_bake(m, cells))
    else:
        print(emit.to_markdown(m, cells))
    return 0


def _cmd_matrix_outdated(a: argparse.Namespace) -> int:
    from attnkit.matrix import load_matrix
    from attnkit.matrix.outdated import TRACKED, check_index_url, outdated

    given = [f"--{opt}" for opt in ("torch", "cuda", "python", "package") if getattr(a, opt) is not None]
    if given or a.shards or a.format != "table":
        raise UsageError(f"matrix outdated: takes --file and --index-url only, not {', '.join(given) or '--format/--shards'}")
    index = check_index_url(a.index_url)
    found = outdated(load_matrix(a.file), index)
    for f in found:
        print(f.line())
    if not found:
        print(f"the matrix is up to date with {index} ({', '.join(TRACKED)})")
    return 1 if found else 0


def _cmd_ci_plan(a: argparse.Namespace) -> int:
    from attnkit.matrix import CellFilter, emit, expand, load_matrix

    m = load_matrix(a.file)
    cells = expand(m, CellFilter(torch=a.torch))
    if a.format == "json":
        print(json.dumps(emit.ci_plan(cells), indent=1))
    else:
        emit.print_ci_plan(cells)
    return 0


def _cmd_readme(a: argparse.Namespace) -> int:
    from attnkit._io import write_atomic
    from attnkit.matrix import emit, expand, load_matrix

    m = load_matrix(a.file)
    readme = Path(a.readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as exc:
        raise AttnkitError(f"--readme {readme}: cannot read ({exc.strerror})") from None
    try:
        new = emit.replace_readme_table(text, emit.to_markdown(m, expand(m)))
    except ValueError as exc:
        raise AttnkitError(f"--readme {readme}: {exc}") from None
    if new == text:
        print(f"{readme}: matrix table is up to date")
        return 0
    if a.check:
        raise AttnkitError(f"--readme {readme}: matrix table is out of date; run `nox -s readme`")
    write_atomic(readme, new)
    print(f"{readme}: matrix table updated")
    return 0


def _cmd_doctor(a: argparse.Namespace) -> int:
    from attnkit.runtime.doctor import run_doctor

    return run_doctor(as_json=a.json)


def _cmd_bench(a: argparse.Namespace) -> int:
    if a.integrations:  # the HF training step, kernels in a compiled graph, CUDA-graph decode: its own options
        from attnkit.bench.integrations import main as integrations

        if not a.out:
            raise UsageError("--out: required with --integrations (the JSON report)")
        extra = [f"--{k}={getattr(a, k)}" for k in ("layers", "tokens", "batch", "iters", "replays")
                 if getattr(a, k) is not None]
        return integrations(["--out", a.out, *extra, *(f"--only={o}" for o in a.only or ())])
    from attnkit.bench.run import run_bench

    return run_bench(out=a.out, quick=a.quick, png=a.png, only=a.shape)


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
        return merge(a.merge, a.out)
    if not a.tests:
        raise UsageError("--tests: required (flash-attention's tests/test_flash_attn.py, or a checkout holding it); "
                         "or --merge REPORT... to join shard reports")
    return run_oracle(a.tests, out=a.out, budget=a.budget, shard=a.shard, backends=a.backend,
                      words=a.filter.split(",") if a.filter else None)


def _cmd_tune(a: argparse.Namespace) -> int:
    from attnkit.bench import tune

    if a.merge:
        if not a.table:
            raise UsageError("--table: required with --merge (where <arch>.json goes, e.g. "
                             "src/attnkit/data/selection/sm90.json)")
        table = tune.merge([Path(f) for f in a.merge], arch=a.arch)
        write_atomic(Path(a.table), json.dumps(table, indent=1) + "\n")
        print(f"wrote {a.table}: {len(table['cells'])} cells from {table['provenance']['cases']} cases")
        if a.png:
            png = Path(a.table).with_suffix(".png") if a.png == "-" else Path(a.png)
            tune.chart(table, png)
            print(f"wrote {png}")
        return 0
    if a.validate:
        rep = tune.validate(Path(a.out) if a.out else None, quick=a.quick)
        print(json.dumps(rep["summary"], indent=1))
        return 0
    if a.plan:
        cases = tune.plan(tune.QUICK if a.quick else tune.FEATURES)
        mine = cases[a.shard[0] - 1::a.shard[1]] if a.shard else cases
        for s in mine:
            print(s.label)
        print(f"{len(mine)} cases", file=sys.stderr)
        return 0
    if a.compile_only:
        print(json.dumps(tune.compile_only(shard=a.shard or (1, 1), quick=a.quick, max_cases=a.max_cases)))
        return 0
    if not a.out:
        raise UsageError("--out: required (the JSON-lines file this shard's results are appended to)")
    out = Path(a.out)
    if out.exists() and not a.resume:
        raise UsageError(f"--out: {out} exists; pass --resume to continue it, or choose a new file")
    res = tune.run(out, shard=a.shard or (1, 1), budget_s=a.budget, quick=a.quick,
                   refine_from=[Path(f) for f in a.refine] if a.refine else None, max_cases=a.max_cases)
    print(json.dumps(res))
    return 0


def _shard_arg(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"([0-9]{1,4})/([0-9]{1,4})", text, flags=re.ASCII)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N (e.g. 2/4), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    """An option that counts something (jobs, shards, tokens, a batch): an integer >= 1, else exit 2."""
    value = int(text) if re.fullmatch(r"[0-9]{1,9}", text.strip(), flags=re.ASCII) else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _cmd_warmup(a: argparse.Namespace) -> int:
    from attnkit.runtime.warmup import load_shapes, run_warmup, shapes_from_model

    if bool(a.shapes) == bool(a.model):
        raise UsageError("warmup: give --shapes FILE.json or --model CONFIG (config.json or its folder)")
    shapes = load_shapes(a.shapes) if a.shapes else shapes_from_model(a.model, a.seqlen, a.batch, a.dtype)
    return run_warmup(shapes, report=a.report, dry_run=a.dry_run, as_json=a.json)


def _spec(a: argparse.Namespace, plan: bool = False):  # type: ignore[no-untyped-def]
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.recipe import load_recipe, resolve

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    recipe, path = load_recipe(a.package, a.recipe)
    spec = resolve(m, cell, recipe, path, shared_ok=plan)
    if getattr(a, "option", None):
        from attnkit.wheels.recipe import with_options

        spec = with_options(spec, a.option)
    if getattr(a, "archs", None):
        from attnkit.wheels.recipe import restrict

        spec = restrict(spec, a.archs)
    return spec


def _cmd_wheels_build(a: argparse.Namespace) -> int:
    from attnkit._io import write_atomic
    from attnkit.wheels.compile import build_wheel, report_dict
    from attnkit.wheels.shards import parse_shard

    shard = parse_shard(a.shard) if a.shard else None
    if shard and a.link_only:
        raise UsageError("--shard and --link-only: a job either compiles a shard or links them all")
    if (shard or a.link_only) and not a.objects:
        raise UsageError("--objects: required with --shard and --link-only (the store the jobs share)")
    spec = _spec(a)
    rep = build_wheel(spec, Path(a.out), python=a.python, build_dir=Path(a.build_dir) if a.build_dir else None,
                      toolkit=a.toolkit, jobs=a.jobs, verify=not a.no_verify, shard=shard, link_only=a.link_only,
                      also=tuple(a.also_python),
                      objects=Path(a.objects) if a.objects else None, costs=[Path(c) for c in a.costs] if a.costs else None)
    doc = json.dumps(report_dict(rep), indent=1)
    if a.report:
        write_atomic(a.report, doc)
    print(doc)
    return 0


def _cmd_wheels_plan(a: argparse.Namespace) -> int:
    from attnkit.wheels.compile import build_wheel
    from attnkit.wheels.shards import Unit, load_recorded, plan_summary, print_plan

    if a.shards < 1:
        raise UsageError(f"--shards: must be >= 1, got {a.shards}")
    spec = _spec(a, plan=True)  # any cell that carries the package: its units are the same
    rep = build_wheel(spec, Path("."), python=a.python, build_dir=Path(a.build_dir) if a.build_dir else None,
                      toolkit=a.toolkit, jobs=a.jobs, plan_only=True)
    assert rep.shard is not None
    units = [Unit(**u) for u in rep.shard["unit_list"]]
    plan = plan_summary(units, a.shards, dict(spec.recipe.build.unit_cost), load_recorded(a.costs))
    plan.update(package=spec.package, cell=spec.cell.id, archs=rep.archs)
    if a.json:
        print(json.dumps(plan, indent=1))
    else:
        print_plan(plan)
    return 0


def _cmd_wheels_verify(a: argparse.Namespace) -> int:
    from attnkit.wheels.accept import accept, verification_path
    from attnkit.wheels.verify import verify_wheel

    wheel = Path(a.wheel)
    if not wheel.is_file():
        raise AttnkitError(f"WHEEL {wheel}: no such file")
    if a.package is None and a.recipe is None:
        from packaging.utils import parse_wheel_filename

        a.package = str(parse_wheel_filename(wheel.name)[0])
    rep = verify_wheel(wheel, _spec(a), python=a.python, also=tuple(a.also_python))
    print(json.dumps(rep.to_dict(), indent=1))
    if not rep.ok:
        raise AttnkitError(f"verify: {wheel.name} rejected: {'; '.join(rep.problems)}")
    if a.accept_to:
        accept(wheel, Path(a.accept_to), rep.to_dict())
    else:
        from attnkit._io import write_atomic

        write_atomic(verification_path(wheel), json.dumps(rep.to_dict(), indent=1))
    return 0


def _cmd_wheels_finalize(a: argparse.Namespace) -> int:
    from attnkit.wheels.accept import finalize

    wheel = Path(a.wheel)
    if not wheel.is_file():
        raise AttnkitError(f"WHEEL {wheel}: no such file")
    final, _ = finalize(wheel, _spec(a), Path(a.out), python=a.python, also=tuple(a.also_python))
    print(final)
    return 0


def _cmd_wheels_toolkit(a: argparse.Namespace) -> int:
    from attnkit._io import cache_dir
    from attnkit.wheels.toolkit import resolve_toolkit

    spec = _spec(a)
    assert spec.cell.cuda is not None
    tk = resolve_toolkit(a.toolkit, spec.cell.cuda, spec.toolkit_pypi, cache_dir() / "toolkits", a.python)
    print(tk.home)
    return 0


def _cmd_wheels_source(a: argparse.Namespace) -> int:
    from attnkit._io import cache_dir
    from attnkit.wheels.source import prepare_source

    dest = Path(a.dest)
    print(prepare_source(_spec(a), dest, cache_dir()))
    return 0


def _cmd_wheels_env(a: argparse.Namespace) -> int:
    import shlex

    from attnkit.wheels.compile import recipe_env
    from attnkit.wheels.sizing import jobs_for

    spec = _spec(a)
    env = recipe_env(spec, jobs_for(spec, a.jobs)[0])
    if a.format == "json":
        print(json.dumps(env, indent=1))
    else:
        for k, v in env.items():
            print(f"{k}={shlex.quote(v)}")
    return 0


def _cmd_wheels_torch(a: argparse.Namespace) -> int:
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.pyenv import torch_requirement

    cell = find_cell(load_matrix(a.file), a.cell)
    req, index = torch_requirement(cell)
    if a.format == "json":
        print(json.dumps({"cell": cell.id, "python": cell.python, "requirement": req, "index_url": index}))
    else:
        print(f"{req} --index-url {index}")
    return 0


def _cmd_index_build(a: argparse.Namespace) -> int:
    from attnkit.matrix import load_matrix
    from attnkit.wheels.index import build_index

    entries = build_index(Path(a.dir), Path(a.out), a.base_url, a.site_url, matrix=load_matrix(a.file))
    print(f"{a.out}: indexed {len({e.filename for e in entries})} wheel(s) of {len({e.project for e in entries})} "
          f"project(s) in "
          f"{len({e.key for e in entries})} index(es) (one per key), {len({e.cell for e in entries})} cell page(s)")
    return 0


def _cmd_images_wheelhouse(a: argparse.Namespace) -> int:
    from attnkit.images.wheelhouse import build_wheelhouse
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    cell = find_cell(load_matrix(a.file), a.cell)
    manifest = build_wheelhouse(cell, Path(a.out), Path(a.wheels) if a.wheels else None, a.index,
                                test_builds=a.test_builds, without=tuple(a.without or ()))
    files, size = manifest["files"], manifest["bytes"]
    assert isinstance(files, list) and isinstance(size, int)
    print(f"{a.out}: {len(files)} wheels ({size / 2**20:.0f} MiB) for {cell.id}")
    return 0


def _cmd_images_build(a: argparse.Namespace) -> int:
    from attnkit._io import write_atomic
    from attnkit.images.base import local_base
    from attnkit.images.build import build_image, report_dict
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    base = local_base(m, cell, a.variant) if a.local_base else a.base_image
    rep = build_image(m, cell, a.variant, target=a.target, base_image=base, builder=a.builder,
                      context=Path(a.context))
    doc = json.dumps(report_dict(rep), indent=1)
    if a.report:
        write_atomic(a.report, doc)
    print(doc)
    size = f"{rep.size_bytes / 2**20:.0f} MiB" if rep.size_bytes else "unknown size"
    print(f"built {rep.tag} ({rep.target}) with {rep.builder} in {rep.seconds:.0f} s: {size}", file=sys.stderr)
    return 0


def _cmd_images_report(a: argparse.Namespace) -> int:
    import tempfile

    from attnkit._io import write_atomic
    from attnkit.images.base import local_base
    from attnkit.images.build import detect_builder
    from attnkit.images.report import full_report
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    base = local_base(m, cell, a.variant) if a.local_base else (a.base_image or cell.base_images[a.variant])
    logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="attnkit-image-logs-"))
    rep = full_report(m, cell, a.variant, base_image=base, builder=a.builder or detect_builder(),
                      context=Path(a.context), logs=logs)
    doc = json.dumps(rep, indent=1, default=str)
    if a.out:
        write_atomic(a.out, doc)
    print(doc)
    if rep["problems"]:
        raise AttnkitError(f"images: {cell.id} {a.variant}: {'; '.join(rep['problems'])}")
    return 0


def _cmd_images_promote(a: argparse.Namespace) -> int:
    from attnkit._io import write_atomic
    from attnkit.images.promote import promote
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    variants = a.variant or ["runtime", "devel"]
    if a.push and len(variants) != 1:
        raise UsageError("--push: give exactly one --variant with it (the local image is that variant's)")
    rep = promote(m, cell, variants, tool=a.tool, registry=a.registry, image=a.image,
                  push_local={variants[0]: a.push} if a.push else None, tls_verify=a.tls_verify == "true")
    doc = json.dumps(rep.as_dict(), indent=1)
    if a.report:
        write_atomic(a.report, doc)
    print(doc)
    if not rep.promoted:
        left = [t for ts in rep.moving_tags.values() for t in ts]
        raise AttnkitError(f"images promote: {rep.why_not}; moving tags left where they were: {', '.join(left) or 'none'}")
    moved = [t for ts in rep.moved.values() for t in ts]
    print(f"promoted {cell.id}: smoke {rep.smoke_counts}; {', '.join(moved) or 'no moving tags for this cell'} -> "
          f"{', '.join(sorted(set(rep.digests.values())))}", file=sys.stderr)
    return 0


def _default_site(a: argparse.Namespace) -> str:
    if a.index:
        return str(a.index)
    from attnkit.matrix import load_matrix

    return load_matrix(None).publish.wheel_site


def _chosen(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from attnkit.wheels import pyenv
    from attnkit.wheels.resolve import choose, index_url, listing, stable_listing

    source = "--index"
    if not a.index:  # attnkit's own site: only the matrix's packages are there; say so before any network
        from attnkit.matrix import load_matrix

        known = sorted(load_matrix(None).packages)
        if a.package not in known:
            raise UsageError(f"package: {a.package!r} is not built by attnkit (its site has {', '.join(known)}); "
                             "pass --index SITE for another wheel site")
        source = "the default wheel site (matrix.yaml publish.wheel_site; it may not be published yet; --index SITE)"
    env = pyenv.describe(a.python)
    site = _default_site(a)
    simple = index_url(site, env)
    stable = stable_listing(site, a.package)  # the site's stable-ABI wheels: they may serve a key with no page
    try:
        cands = listing(simple, a.package, source)
    except AttnkitError:
        if not stable:
            raise
        cands = []
    return env, simple, choose(cands, env, a.package, stable)


def _cmd_wheel_url(a: argparse.Namespace) -> int:
    from attnkit.wheels.index import install_commands

    _, simple, c = _chosen(a)
    print(f"{c.url}#sha256={c.sha256}" if c.sha256 else c.url)
    for tool, cmd in install_commands(simple, a.package, c.version.public).items():
        print(f"{tool + ':':4} {cmd}", file=sys.stderr)
    return 0


def _cmd_install(a: argparse.Namespace) -> int:
    from attnkit.wheels.resolve import install

    env, _, c = _chosen(a)
    tool = install(c, a.package, env, deps=not a.no_deps)
    print(f"installed {c.filename} (sha256 {c.sha256}) with {tool}; torch stays {env.torch}")
    return 0


def _cmd_index_key(a: argparse.Namespace) -> int:
    from attnkit.matrix import naming

    if a.torch is None and a.cuda is None:
        from attnkit.wheels import pyenv

        print(pyenv.describe(a.python).index_key())
        return 0
    if a.torch is None or a.cuda is None:
        raise UsageError("index key: give both --torch X.Y and --cuda X.Y (or neither: the key of --python's torch)")
    abi = a.abi
    if abi is None:
        from attnkit.matrix import load_matrix

        rel = load_matrix(a.file).torch.get(a.torch)
        if rel is None:
            raise UsageError(f"--torch {a.torch}: not in the matrix; pass --abi TRUE|FALSE")
        abi = "TRUE" if rel.cxx11_abi else "FALSE"
    print(naming.index_key(a.cuda, a.torch, abi == "TRUE"))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnkit")
    except PackageNotFoundError:  # run from a source tree that is not installed (PYTHONPATH=src)
        from attnkit import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="attnkit", description=__doc__)
    p.add_argument("--version", action="version", version=f"attnkit {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mx = sub.add_parser("matrix", help="expand matrix.yaml into cells")
    mx.add_argument("--file", help="matrix file (default: $ATTNKIT_MATRIX, ./matrix.yaml, the checkout's)")
    mx.add_argument("--torch", metavar="X.Y")
    mx.add_argument("--cuda", metavar="X.Y|cpu")
    mx.add_argument("--python", metavar="X.Y")
    mx.add_argument("--package", metavar="NAME")
    mx.add_argument("--shards", action="store_true", help="with --format github --package: one job per compile "
                                                          "shard of each wheel")
    mx.add_argument("--format", choices=FORMATS, default="table")
    mx.set_defaults(func=_cmd_matrix)
    mxsub = mx.add_subparsers(dest="matrix_command", parser_class=_Parser)
    mo = mxsub.add_parser("outdated", help="what PyPI has that is newer than the matrix: one line each, exit 1 if any")
    mo.add_argument("--file", default=argparse.SUPPRESS, help="matrix file (as for `attnkit matrix`)")
    mo.add_argument("--index-url", default="https://pypi.org/pypi",
                    help="the index's JSON API root, <url>/<name>/json (default: https://pypi.org/pypi)")
    mo.set_defaults(func=_cmd_matrix_outdated)

    cp = sub.add_parser("ci-plan", help="the jobs a push would start, per cell (dry run of the workflows)")
    cp.add_argument("--file")
    cp.add_argument("--torch", metavar="X.Y")
    cp.add_argument("--format", choices=("table", "json"), default="table")
    cp.set_defaults(func=_cmd_ci_plan)

    rd = sub.add_parser("readme", help="regenerate (or --check) the README's matrix table")
    rd.add_argument("--file")
    rd.add_argument("--readme", default="docs/matrix.md", help="the markdown file holding the matrix table")
    rd.add_argument("--check", action="store_true", help="fail if the table is out of date")
    rd.set_defaults(func=_cmd_readme)

    dr = sub.add_parser("doctor", help="probe this machine and show which attention backends work")
    dr.add_argument("--json", action="store_true", help="print the report as JSON (exit 1 when unhealthy)")
    dr.set_defaults(func=_cmd_doctor)

    be = sub.add_parser("bench", help="benchmark every available backend against attnkit's choice")
    be.add_argument("--out", default=None, help="JSON report path (a PNG chart is written beside it)")
    be.add_argument("--quick", action="store_true", help="a small suite (CPU sanity runs)")
    be.add_argument("--no-png", dest="png", action="store_false", help="write no PNG chart beside the report")
    be.add_argument("--shape", action="append", help="only this shape of the suite (by label; repeatable)")
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
    orc.add_argument("--shard", type=_shard_arg, help="I/N: run the I-th of N parts (split by kernel configuration)")
    orc.add_argument("--backend", action="append", help="only this backend ('attnkit': attention()'s pick); repeatable")
    orc.add_argument("--filter", help="keep cases whose tag holds every comma-separated word, e.g. varlen,alibi=True")
    orc.add_argument("--merge", nargs="+", metavar="REPORT", help="join shard reports into one (--out)")
    orc.set_defaults(func=_cmd_oracle)

    tu = sub.add_parser("tune", help="measure every backend over a grid of call features; write selection tables")
    tu.add_argument("--out", help="JSON-lines results of this shard (appended case by case; see --resume)")
    tu.add_argument("--resume", action="store_true", help="continue an existing --out file (skips its cases)")
    tu.add_argument("--shard", type=_shard_arg, help="I/N: run the I-th of N parts of the plan")
    tu.add_argument("--budget", type=_seconds_arg, default=1500.0, help="stop starting cases after this many seconds")
    tu.add_argument("--max-cases", type=_positive_int, help="run at most this many cases now")
    tu.add_argument("--quick", action="store_true", help="the small grid (a CPU run of the whole pipeline)")
    tu.add_argument("--refine", nargs="+", metavar="FILE", help="measure midpoints where these results' winners change")
    tu.add_argument("--plan", action="store_true", help="print the planned cases (of --shard) and their count")
    tu.add_argument("--compile-only", action="store_true", help="run each case once, untimed, so JIT kernels are "
                                                               "compiled into their disk caches (shards side by side)")
    tu.add_argument("--merge", nargs="+", metavar="FILE", help="turn result files into a selection table (--table)")
    tu.add_argument("--table", help="with --merge: the table to write (e.g. src/attnkit/data/selection/sm90.json)")
    tu.add_argument("--arch", help="with --merge: the table's architecture name (default: from the results' GPU)")
    tu.add_argument("--png", nargs="?", const="-", help="with --merge: a PNG of the winner per point (default: "
                                                        "beside --table)")
    tu.add_argument("--validate", action="store_true", help="time held-out shapes (not grid points): attnkit against "
                                                           "the fastest correct candidate; --out writes the report")
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

    wh = sub.add_parser("wheels", help="build and verify prebuilt wheels")
    wsub = wh.add_subparsers(dest="wheels_command", required=True, parser_class=_Parser)

    def cell_only(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--cell", required=True, help="cell id, e.g. torch2.11-cu130-py312")
        sp.add_argument("--file", help="matrix file")

    def cell_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--package", help="a packaged recipe: flash-attn or xformers")
        sp.add_argument("--recipe", help="a recipe file instead of --package")
        cell_only(sp)
        sp.add_argument("--python", default=sys.executable, help="interpreter with the cell's torch")

    def also_python(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--also-python", action="append", default=[], metavar="PY",
                        help="verify the import under this interpreter's torch too (repeatable); a stable-ABI "
                             "wheel needs one with another torch minor >= its floor")

    def build_args(sp: argparse.ArgumentParser) -> None:
        cell_args(sp)
        sp.add_argument("--build-dir", help="persistent build folder (resume); default in the cache")
        sp.add_argument("--toolkit", default="auto", help="auto (CUDA_HOME, /usr/local/cuda, PATH), pypi, or a path")
        sp.add_argument("--jobs", type=_positive_int, help="parallel compile jobs (default: from cores and memory)")
        sp.add_argument("--archs", help="a test build for a subset of the cell's archs, e.g. 90 (wheel marked .sm90)")
        sp.add_argument("--option", action="append", metavar="NAME=VALUE",
                        help="a recipe option (its [options], e.g. FLASH_ATTENTION_DISABLE_FP8=TRUE): a trimmed test "
                             "build, its wheel marked .trim<hash> (repeatable)")
        sp.add_argument("--costs", action="append", metavar="FILE",
                        help="measured seconds per unit to balance shards by: {source: seconds}, or shard "
                             "reports (repeat it to merge several; a later file wins)")

    wb = wsub.add_parser("build", help="build one package for one cell, verify it, put it in --out")
    build_args(wb)
    wb.add_argument("--out", default="wheelhouse")
    wb.add_argument("--no-verify", action="store_true")
    wb.add_argument("--report", help="also write the build report JSON here")
    wb.add_argument("--shard", metavar="I/N", help="compile only shard I of N into --objects; link nothing")
    wb.add_argument("--link-only", action="store_true", help="gather every unit from --objects, link, verify")
    wb.add_argument("--objects", help="the object store a sharded build's shard and link jobs share")
    also_python(wb)
    wb.set_defaults(func=_cmd_wheels_build)

    wp = wsub.add_parser("plan", help="the compile units of a build split into N shards, with their cost")
    build_args(wp)
    wp.add_argument("--shards", type=_positive_int, required=True, help="number of shard jobs")
    wp.add_argument("--json", action="store_true", help="print the plan as JSON")
    wp.set_defaults(func=_cmd_wheels_plan)

    def wheel_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("wheel")
        cell_args(sp)
        sp.add_argument("--archs", help="a test build made with `wheels build --archs` (a subset of the cell's)")
        sp.add_argument("--option", action="append", metavar="NAME=VALUE", help="as for `wheels build`")
        also_python(sp)

    wv = wsub.add_parser("verify", help="verify a wheel for a cell (archs, import, torch pin, auditwheel)")
    wheel_args(wv)
    wv.add_argument("--accept-to", help="on success, move it (with its report) into this wheelhouse")
    wv.set_defaults(func=_cmd_wheels_verify)

    wf = wsub.add_parser("finalize", help="name, pin, verify and accept a wheel built elsewhere (cibuildwheel repair)")
    wheel_args(wf)
    wf.add_argument("--out", required=True)
    wf.set_defaults(func=_cmd_wheels_finalize)

    wt = wsub.add_parser("toolkit", help="print a CUDA_HOME for the cell (provisioning it from PyPI with --toolkit pypi)")
    cell_args(wt)
    wt.add_argument("--toolkit", default="auto")
    wt.set_defaults(func=_cmd_wheels_toolkit)

    ws = wsub.add_parser("source", help="fetch (sha256-checked) and unpack the package source into --dest")
    cell_args(ws)
    ws.add_argument("--dest", required=True)
    ws.set_defaults(func=_cmd_wheels_source)

    we = wsub.add_parser("env", help="the build environment of a recipe for a cell (for CI / cibuildwheel)")
    cell_args(we)
    we.add_argument("--jobs", type=_positive_int, help="parallel compile jobs (default: from cores and memory)")
    we.add_argument("--format", choices=("shell", "json"), default="shell")
    we.set_defaults(func=_cmd_wheels_env)

    wto = wsub.add_parser("torch", help="the cell's torch as pip arguments (requirement and PyTorch index)")
    cell_only(wto)
    wto.add_argument("--format", choices=("pip", "json"), default="pip")
    wto.set_defaults(func=_cmd_wheels_torch)

    ix = sub.add_parser("index", help="the wheel site: one PEP 503 index per environment key")
    isub = ix.add_subparsers(dest="index_command", required=True, parser_class=_Parser)
    ib = isub.add_parser("build", help="write SITE/<key>/simple/ per key, a find-links page per cell, a landing page")
    ib.add_argument("dir", help="wheelhouse with verified wheels")
    ib.add_argument("--out", default="site")
    ib.add_argument("--base-url", help="link wheels here (e.g. release assets) instead of copying them; upload "
                    "SITE/files/*.metadata there too")
    ib.add_argument("--site-url", help="where the site is served (absolute URLs on the landing page)")
    ib.add_argument("--file", help="matrix file: its torch releases are the keys a stable-ABI wheel is listed under")
    ib.set_defaults(func=_cmd_index_build)
    ik = isub.add_parser("key", help="the index key of an environment (default: --python's torch)")
    ik.add_argument("--python", default=sys.executable, help="interpreter whose torch decides (default: this one)")
    ik.add_argument("--torch", metavar="X.Y", help="instead: torch major.minor ...")
    ik.add_argument("--cuda", metavar="X.Y", help="... and its CUDA")
    ik.add_argument("--abi", choices=("TRUE", "FALSE"), help="C++11 ABI (default: the matrix's, for --torch)")
    ik.add_argument("--file", help="matrix file (for the default --abi)")
    ik.set_defaults(func=_cmd_index_key)

    im = sub.add_parser("images", help="build a cell's image")
    imsub = im.add_subparsers(dest="images_command", required=True, parser_class=_Parser)
    iw = imsub.add_parser("wheelhouse", help="the hashed, offline wheelhouse an image installs from")
    iw.add_argument("--cell", required=True)
    iw.add_argument("--out", default="wheelhouse")
    iw.add_argument("--wheels", help="verified wheelhouse with the cell's flash-attn/xformers wheels")
    iw.add_argument("--index", help="torch index (default: PyTorch's, for the cell's CUDA or cpu)")
    iw.add_argument("--test-builds", action="store_true", help="accept `wheels build --archs` test builds "
                    "(named '.sm90') where the cell's full wheel is missing; the manifest lists them")
    iw.add_argument("--without", action="append", metavar="PACKAGE", help="leave this package of the cell out "
                    "(repeatable; the manifest records it)")
    iw.add_argument("--file")
    iw.set_defaults(func=_cmd_images_wheelhouse)
    def image_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--cell", required=True)
        sp.add_argument("--variant", choices=("runtime", "devel"), default="runtime")
        sp.add_argument("--base-image", help="override BASE_IMAGE (e.g. a local base)")
        sp.add_argument("--local-base", action="store_true", help="make and use a base here: Debian (debootstrap), "
                        "for CUDA cells a stand-in for nvidia/cuda (its container environment; the cell's PyPI "
                        "toolkit for devel)")
        sp.add_argument("--builder", choices=("docker", "podman"))
        sp.add_argument("--context", default=".", help="build context holding wheelhouse/ (default: .)")
        sp.add_argument("--file")

    ibd = imsub.add_parser("build", help="build with docker buildx (engine present) or podman")
    image_args(ibd)
    ibd.add_argument("--target", choices=("runtime", "devel", "smoke", "os", "env"),
                     help="Dockerfile stage (default: the variant); 'smoke' runs nox -s smoke in the image")
    ibd.add_argument("--report")
    ibd.set_defaults(func=_cmd_images_build)
    irp = imsub.add_parser("report", help="build (twice), check inside without a GPU, and report size, layers, "
                           "CUDA libraries, doctor, smoke")
    image_args(irp)
    irp.add_argument("--out", help="write the JSON report here")
    irp.add_argument("--logs", help="keep the build logs here")
    irp.set_defaults(func=_cmd_images_report)

    ipr = imsub.add_parser("promote", help="the smoke gate: (push,) pull by digest, `nox -s smoke` inside, then point "
                           "the cell's moving tags at exactly that digest; a failed smoke moves none (exit 1)")
    ipr.add_argument("--cell", required=True)
    ipr.add_argument("--variant", action="append", choices=("runtime", "devel"),
                     help="repeatable (default: both); the smoke runs in the runtime image")
    ipr.add_argument("--registry", help="default: matrix.yaml publish.registry (e.g. 127.0.0.1:5000/attnkit)")
    ipr.add_argument("--image", help="repository name (default: matrix.yaml publish.image)")
    ipr.add_argument("--tool", choices=("docker", "podman"), default="docker",
                     help="docker (docker run, buildx imagetools) or podman (buildah run, chroot isolation)")
    ipr.add_argument("--push", metavar="LOCAL_IMAGE", help="push this local image to the immutable tag first "
                     "(CI's bake already pushed it)")
    ipr.add_argument("--tls-verify", choices=("true", "false"), default="true",
                     help="podman: false for a plain-HTTP registry on 127.0.0.1")
    ipr.add_argument("--report", help="write the JSON report (tags, digests, smoke counts) here")
    ipr.add_argument("--file")
    ipr.set_defaults(func=_cmd_images_promote)

    for name, func, text in (("wheel-url", _cmd_wheel_url, "print the URL of the wheel that fits this environment "
                                                           "(and the pip / uv commands, on stderr)"),
                             ("install", _cmd_install, "install the wheel that fits, hash-checked, with its "
                                                       "dependencies; torch is never changed")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("package", help="the project to find: flash-attn or xformers on attnkit's site (any project "
                                        "on a site given with --index)")
        sp.add_argument("--index", help="a wheel site (URL or folder; its <key>/simple is used) or one simple index "
                        "(ends in /simple); default: matrix.yaml publish.wheel_site")
        sp.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
        if name == "install":
            sp.add_argument("--no-deps", action="store_true", help="install the wheel alone")
        sp.set_defaults(func=func)
    return p


def _validate_versions(a: argparse.Namespace) -> None:
    import re

    opts: tuple[str, ...]
    if a.command in ("matrix", "ci-plan"):
        opts, cpu_ok = ("torch", "python"), True
    elif getattr(a, "index_command", None) == "key":
        opts, cpu_ok = ("torch",), False  # its --python is an interpreter; wheels need CUDA
    else:
        return
    minor = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}\Z", re.ASCII)  # ASCII digits: '３.１２' is not a version
    for opt in opts:
        val = getattr(a, opt, None)
        if val is not None and not minor.match(val):
            raise UsageError(f"--{opt}: {val!r} is not MAJOR.MINOR (e.g. 2.11)")
    cuda = getattr(a, "cuda", None)
    if cuda is not None and not (cpu_ok and cuda == "cpu") and not minor.match(cuda):
        raise UsageError(f"--cuda: {cuda!r} is not MAJOR.MINOR (e.g. 13.0){' or cpu' if cpu_ok else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so a running build stops its compiler processes too

    if threading_main():
        signal.signal(signal.SIGTERM, _term)
    try:
        args = build_parser().parse_args(argv)
        _validate_versions(args)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except UsageError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 2
    except (AttnkitError, WriteError) as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the machine refused (a path too long, a full disk, no permission): one line, no traceback
        where = f"{shown(exc.filename)[:300]}: " if getattr(exc, "filename", None) else ""
        print(f"attnkit: error: {where}{exc.strerror or first_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
