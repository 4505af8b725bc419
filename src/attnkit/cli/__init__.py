"""The `attnkit` command: parses arguments, calls the library, prints. Every error is one line on stderr
("attnkit: error: ..."), no traceback: exit status 2 for a usage error (the command line itself), 1 for a
failure (a bad file, a missing tool, a wheel that does not fit)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from attnkit._io import WriteError
from attnkit.bench.tune import REFRESH_KINDS
from attnkit.cli import images, index, matrix, runtime, wheels
from attnkit.cli._args import _Parser, _version
from attnkit.errors import AttnkitError, UsageError, first_line, shown

# options that name a file or folder, in any subcommand
PATH_OPTIONS = ("out", "report", "claims", "dest", "tests", "table", "png", "file", "cache_dir", "wheelhouse",
                "rescore")
# options taking several paths (`tune --merge A B`, `oracle --resume R1 R2`): an empty one among them, the same
LIST_PATH_OPTIONS = ("merge", "cross_check", "refine", "resume", *(f"refresh_{k}" for k in REFRESH_KINDS))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="attnkit", description=__doc__)
    p.add_argument("--version", action="version", version=f"attnkit {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for part in (matrix, runtime, wheels, index, images):  # the order of `attnkit --help`
        part.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so a running build stops its compiler processes too

    if threading_main():
        signal.signal(signal.SIGTERM, _term)
    try:
        args = build_parser().parse_args(argv)
        empty = next((d for d in PATH_OPTIONS if getattr(args, d, None) == ""), None) or next(
            (d for d in LIST_PATH_OPTIONS if isinstance(getattr(args, d, None), list) and "" in getattr(args, d)),
            None)
        if empty is not None:  # '' would be the current folder: an index built there replaces it
            raise UsageError(f"--{empty.replace('_', '-')}: an empty path; give a file or folder name")
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except AttnkitError as exc:  # UsageError included: each class carries its exit status
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except WriteError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `attnkit matrix | head`: the reader went away, nothing is wrong
        return 0
    except OSError as exc:  # the machine refused (a path too long, a full disk, no permission): one line, no traceback
        where = f"{shown(exc.filename)[:300]}: " if getattr(exc, "filename", None) else ""
        print(f"attnkit: error: {where}{exc.strerror or first_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
