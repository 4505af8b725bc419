"""What every subcommand's parser shares: the parser class whose errors are one line (exit 2), the option
value types, and the version checks of --torch / --python / --cuda."""

from __future__ import annotations

import argparse
import math
import re
from typing import NoReturn

from attnkit.errors import UsageError

FORMATS = ("table", "json", "github", "bake", "markdown")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")



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




def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnkit")
    except PackageNotFoundError:  # run from a source tree that is not installed (PYTHONPATH=src)
        from attnkit import __version__

        return __version__




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


