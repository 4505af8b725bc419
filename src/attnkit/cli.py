"""The `attnkit` command: parses arguments, calls the library, prints. Every user error is one line on
stderr ("attnkit: error: ...") with exit status 2; no tracebacks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from attnkit.errors import AttnkitError

FORMATS = ("table", "json", "github", "bake", "markdown")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise AttnkitError(f"{self.prog}: {message}")


def _cmd_matrix(a: argparse.Namespace) -> int:
    from attnkit.matrix import CellFilter, emit, expand, load_matrix

    m = load_matrix(a.file)
    cells = expand(m, CellFilter(torch=a.torch, cuda=a.cuda, python=a.python, package=a.package))
    if a.format == "table":
        emit.print_table(m, cells)
    elif a.format == "json":
        print(emit.to_json(cells))
    elif a.format == "github":
        print(emit.to_github(cells, a.package))
    elif a.format == "bake":
        print(emit.to_bake(m, cells))
    else:
        print(emit.to_markdown(m, cells))
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
    from attnkit.runtime.bench import run_bench

    return run_bench(out=a.out, quick=a.quick, png=a.png)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="attnkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mx = sub.add_parser("matrix", help="expand matrix.yaml into cells")
    mx.add_argument("--file", help="matrix file (default: $ATTNKIT_MATRIX, ./matrix.yaml, the checkout's)")
    mx.add_argument("--torch", metavar="X.Y")
    mx.add_argument("--cuda", metavar="X.Y|cpu")
    mx.add_argument("--python", metavar="X.Y")
    mx.add_argument("--package", metavar="NAME")
    mx.add_argument("--format", choices=FORMATS, default="table")
    mx.set_defaults(func=_cmd_matrix)

    rd = sub.add_parser("readme", help="regenerate (or --check) the README's matrix table")
    rd.add_argument("--file")
    rd.add_argument("--readme", default="README.md")
    rd.add_argument("--check", action="store_true", help="fail if the table is out of date")
    rd.set_defaults(func=_cmd_readme)

    dr = sub.add_parser("doctor", help="probe this machine and show which attention backends work")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=_cmd_doctor)

    be = sub.add_parser("bench", help="benchmark every available backend against attnkit's choice")
    be.add_argument("--out", default=None, help="JSON report path (a PNG chart is written beside it)")
    be.add_argument("--quick", action="store_true", help="a small suite (CPU sanity runs)")
    be.add_argument("--no-png", dest="png", action="store_false")
    be.set_defaults(func=_cmd_bench)
    return p


def _validate_versions(a: argparse.Namespace) -> None:
    import re

    for opt in ("torch", "python"):
        val = getattr(a, opt, None)
        if val is not None and not re.match(r"^\d+\.\d+$", val):
            raise AttnkitError(f"--{opt}: {val!r} is not MAJOR.MINOR (e.g. 2.11)")
    cuda = getattr(a, "cuda", None)
    if cuda is not None and cuda != "cpu" and not re.match(r"^\d+\.\d+$", cuda):
        raise AttnkitError(f"--cuda: {cuda!r} is not MAJOR.MINOR (e.g. 13.0) or 'cpu'")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _validate_versions(args)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except AttnkitError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
