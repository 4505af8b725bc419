"""What every subcommand's parser shares: the parser class whose errors are one line (exit 2), the option
value types (the version checks of --torch / --python / --cuda among them)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
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


_MINOR = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}\Z", re.ASCII)  # ASCII digits: '３.１２' is not a version


def minor_version(example: str, cpu_ok: bool = False) -> Callable[[str], str]:
    """An option value that is a MAJOR.MINOR version (--torch, --python, --cuda; --cuda may also be "cpu")."""
    def check(text: str) -> str:
        if (cpu_ok and text == "cpu") or _MINOR.match(text):
            return text
        raise argparse.ArgumentTypeError(f"{text!r} is not MAJOR.MINOR (e.g. {example}){' or cpu' if cpu_ok else ''}")
    return check


