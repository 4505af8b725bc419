"""Progress for attnkit's long steps (downloads, toolkit provisioning, compiles, image builds): a rich live
display when stderr is a terminal, a plain line now and then otherwise (CI logs), nothing on stdout, which
stays for the command's result."""

from __future__ import annotations

import http.client
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from attnkit.errors import AttnkitError

_LINE_EVERY_S = 15.0


def _tty() -> bool:
    return sys.stderr.isatty()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Counter:
    """Items done / total with elapsed and estimate (a compile's objects, from ninja's `[done/total]`)."""

    def __init__(self, label: str, unit: str = "objects") -> None:
        self.label, self.unit, self.start, self.done, self.total = label, unit, time.monotonic(), 0, 0
        self.first: int | None = None
        self._last_print = 0.0
        self._bar: Any = None
        if _tty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(label, total=None)

    def update(self, done: int, total: int) -> None:
        if self.first is None:
            self.first = done - 1  # ninja counts from the first object it had to (re)build
        self.done, self.total = done, total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
            return
        now = time.monotonic()
        if now - self._last_print >= _LINE_EVERY_S or done == total:
            self._last_print = now
            elapsed = now - self.start
            rate = (done - (self.first or 0)) / elapsed if elapsed > 0 else 0
            eta = (total - done) / rate if rate > 0 else float("nan")
            _say(f"{self.label}: {done}/{total} {self.unit}, {elapsed / 60:.1f} min elapsed, ~{eta / 60:.1f} min left")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def download(url: str, dest: Path, what: str, *, timeout: float = 120) -> Path:
    """Fetch `url` to `dest` through `dest.part` (renamed at the end), showing bytes done / total."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    bar: Any = None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, tmp.open("wb") as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            if _tty():
                from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

                bar = Progress(*Progress.get_default_columns()[:3], DownloadColumn(), TransferSpeedColumn(),
                               transient=True)
                bar.start()
                task = bar.add_task(what, total=total)
            done, last = 0, time.monotonic()
            for chunk in iter(lambda: r.read(1 << 20), b""):
                f.write(chunk)
                done += len(chunk)
                if bar is not None:
                    bar.update(task, completed=done)
                elif time.monotonic() - last >= _LINE_EVERY_S:
                    last = time.monotonic()
                    _say(f"{what}: {done / 2**20:.0f}" + (f"/{total / 2**20:.0f}" if total else "") + " MiB")
        if total is not None and done < total:
            raise AttnkitError(f"{what}: the download of {url} was cut short ({done} of {total} bytes)")
    except http.client.IncompleteRead:  # the server closed early: say so, not "hash mismatch" later
        tmp.unlink(missing_ok=True)
        raise AttnkitError(f"{what}: the download of {url} was cut short") from None
    except (OSError, http.client.HTTPException) as exc:
        tmp.unlink(missing_ok=True)
        raise AttnkitError(f"{what}: cannot download {url} ({type(exc).__name__}: {exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.stop()
    tmp.replace(dest)
    return dest


def run_streamed(cmd: list[str], what: str, step: re.Pattern[str], *, log: IO[str] | None = None,
                 on_line: Callable[[str], None] | None = None, **popen: Any) -> tuple[int, str]:
    """Run `cmd`, keeping its whole output (returned, and copied to `log`), and show the last line that
    matches `step` (an image build's `STEP 3/9: ...`, pip's `Downloading ...`) as progress."""
    status: Any = None
    if _tty():
        from rich.console import Console

        status = Console(stderr=True).status(what)
        status.start()
    lines: list[str] = []
    last = 0.0
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                **popen)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if log is not None:
                log.write(line)
            if on_line is not None:
                on_line(line)
            if step.search(line):
                shown = f"{what}: {line.strip()[:120]}"
                if status is not None:
                    status.update(shown)
                elif time.monotonic() - last >= _LINE_EVERY_S / 3:
                    last = time.monotonic()
                    _say(shown)
        rc = proc.wait()
    finally:
        if status is not None:
            status.stop()
    return rc, "".join(lines)
