"""Where attnkit writes: atomic file output (a temporary file beside the target, then a rename, so a failed
or interrupted command never leaves a half-written file behind) and the one cache folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from attnkit.errors import UsageError, shown


class WriteError(OSError):
    """An output that cannot be written: one line naming the path (an OSError, so callers that tolerate a
    failed write, like the autotune cache, still do). The CLI prints it as any attnkit error."""


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:200]}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise WriteError(f"{shown(target)}: cannot be written ({exc.strerror or type(exc).__name__}); give a path "
                         "in a writable folder") from None
    try:
        # mkstemp makes the file 0600: give it the target's mode, or what a plain open() would (0666 - umask)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise WriteError(f"{shown(target)}: cannot be written ({exc.strerror or type(exc).__name__}); give a path "
                         "in a writable folder") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def check_writable(path: str | Path, option: str) -> None:
    """Refuse, before any work, an output that write_atomic could not write (a folder, a missing or read-only
    parent, a name too long): a run of minutes must not end by losing what it measured."""
    target = Path(path)
    try:
        if target.is_dir():
            raise UsageError(f"{option}: {shown(target)} is a folder; give a file name")
        parent = next(p for p in (target.parent, *target.parent.parents) if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{option}: {shown(target)}: {shown(parent)} is not a writable folder")
        if len(target.name.encode()) > 255:
            raise UsageError(f"{option}: {shown(target)}: the file name is over 255 bytes")
    except OSError as exc:
        raise UsageError(f"{option}: {shown(target)}: {exc.strerror or type(exc).__name__}") from None


def cache_dir() -> Path:
    """$ATTNKIT_CACHE_DIR, else $XDG_CACHE_HOME/attnkit, else ~/.cache/attnkit: sources, build trees, the
    autotune table and FlashAttention-4's compiled kernels all live under it."""
    base = os.environ.get("ATTNKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnkit")
    return Path(base)
