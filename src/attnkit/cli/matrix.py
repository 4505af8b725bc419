"""`attnkit matrix`, `matrix outdated`, `ci-plan`, `readme`: the matrix and what is generated from it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnkit._io import write_atomic
from attnkit.cli._args import FORMATS, _Parser, minor_version
from attnkit.errors import AttnkitError, UsageError


def _cmd_matrix(a: argparse.Namespace) -> int:
    from attnkit.matrix import CellFilter, emit, expand, load_matrix

    m = load_matrix(a.file)
    cells = expand(m, CellFilter(torch=a.torch, cuda=a.cuda, python=a.python, package=a.package, platform=a.platform))
    if a.shards and a.format != "github":
        raise UsageError("--shards: only with --format github --package (one CI job per compile shard)")
    if a.format == "table":
        emit.print_table(m, cells)
    elif a.format == "json":
        print(emit.to_json(cells))
    elif a.format == "github":
        if a.shards and not a.package:
            raise UsageError("--shards: needs --package (shard jobs are per wheel)")
        print(emit.to_github(cells, a.package, shards=a.shards, platform=a.platform))
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
    from attnkit.matrix import emit, expand, load_matrix

    m = load_matrix(a.file)
    readme = Path(a.readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as exc:
        raise AttnkitError(f"--readme {readme}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise AttnkitError(f"--readme {readme}: not UTF-8 text") from None
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


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this module's subcommands to `attnkit`'s parser."""
    mx = sub.add_parser("matrix", help="expand matrix.yaml into cells")
    mx.add_argument("--file", help="matrix file (default: $ATTNKIT_MATRIX, ./matrix.yaml, the checkout's)")
    mx.add_argument("--torch", metavar="X.Y", type=minor_version("2.11"))
    mx.add_argument("--cuda", metavar="X.Y|cpu", type=minor_version("13.0", cpu_ok=True))
    mx.add_argument("--python", metavar="X.Y", type=minor_version("3.12"))
    mx.add_argument("--package", metavar="NAME")
    mx.add_argument("--platform", choices=("linux/amd64", "linux/arm64"),
                    help="cells published for this platform (with --format github --package: its wheels only)")
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
    cp.add_argument("--torch", metavar="X.Y", type=minor_version("2.11"))
    cp.add_argument("--format", choices=("table", "json"), default="table")
    cp.set_defaults(func=_cmd_ci_plan)

    rd = sub.add_parser("readme", help="regenerate (or --check) the README's matrix table")
    rd.add_argument("--file")
    rd.add_argument("--readme", default="docs/matrix.md", help="the markdown file holding the matrix table")
    rd.add_argument("--check", action="store_true", help="fail if the table is out of date")
    rd.set_defaults(func=_cmd_readme)
