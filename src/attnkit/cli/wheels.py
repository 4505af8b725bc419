"""`attnkit wheels ...`: build, plan, verify, finalize one package's wheel for one cell."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnkit._io import write_atomic
from attnkit.cli._args import _Parser, _positive_int
from attnkit.errors import AttnkitError, UsageError


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
    from attnkit.wheels.compile import BuildRequest, build_wheel, report_dict
    from attnkit.wheels.shards import parse_shard

    shard = parse_shard(a.shard) if a.shard else None
    if shard and a.link_only:
        raise UsageError("--shard and --link-only: a job either compiles a shard or links them all")
    if (shard or a.link_only) and not a.objects:
        raise UsageError("--objects: required with --shard and --link-only (the store the jobs share)")
    rep = build_wheel(BuildRequest(_spec(a), Path(a.out), python=a.python, toolkit=a.toolkit, jobs=a.jobs,
                                   build_dir=Path(a.build_dir) if a.build_dir else None, verify=not a.no_verify,
                                   shard=shard, link_only=a.link_only, also=tuple(a.also_python),
                                   objects=Path(a.objects) if a.objects else None,
                                   costs=tuple(Path(c) for c in a.costs or ())))
    doc = json.dumps(report_dict(rep), indent=1)
    if a.report:
        write_atomic(a.report, doc)
    print(doc)
    return 0


def _cmd_wheels_plan(a: argparse.Namespace) -> int:
    from attnkit.wheels.compile import BuildRequest, build_wheel
    from attnkit.wheels.shards import Unit, load_recorded, plan_summary, print_plan

    if a.shards < 1:
        raise UsageError(f"--shards: must be >= 1, got {a.shards}")
    spec = _spec(a, plan=True)  # any cell that carries the package: its units are the same
    rep = build_wheel(BuildRequest(spec, Path("."), python=a.python, toolkit=a.toolkit, jobs=a.jobs, plan_only=True,
                                   build_dir=Path(a.build_dir) if a.build_dir else None))
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
        from packaging.utils import InvalidWheelFilename, parse_wheel_filename

        try:
            a.package = str(parse_wheel_filename(wheel.name)[0])
        except InvalidWheelFilename as exc:
            raise AttnkitError(f"WHEEL {wheel.name}: not a wheel file name ({exc}); pass --package") from None
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


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this module's subcommands to `attnkit`'s parser."""
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
