"""What `attnkit install` may touch: never another distribution's files, never torch.

Why more than a version check: a wheel that ships `torch/__init__.py` overwrites the user's torch while
torch's version string stays the same, and pip exits 0. So before installing, the wheel's file list is
compared with what the target environment's distributions own; after it, every file torch's RECORD lists is
compared (size, mtime, inode) with what it was before.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name

from attnkit.errors import AttnkitError

# Run in the target interpreter: {"owners": {top: [dist, version]}, "torch": {path: "size:mtime_ns:ino"},
# "half": [dist-info folders of PROJECT without RECORD]}. argv: JSON list of top-level names, project name.
_PROBE = r"""
import importlib.metadata as md, json, os, re, sys
tops, project = set(json.loads(sys.argv[1])), sys.argv[2]
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
out = {"owners": {}, "torch": {}, "half": []}
for dist in md.distributions():
    name = dist.metadata["Name"] or ""
    files = dist.files
    if canon(name) == project:
        if files is None and getattr(dist, "_path", None) is not None:
            out["half"].append(str(dist._path))
        continue
    for f in files or ():
        top = f.parts[0] if f.parts else ""
        if top in tops and not top.endswith((".dist-info", ".data")):
            out["owners"].setdefault(top, [name, dist.version])
    if canon(name) == "torch":
        for f in files or ():
            p = f.locate()
            try:
                st = os.stat(p)
            except OSError:
                out["torch"][str(f)] = "missing"
                continue
            out["torch"][str(f)] = "%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino)
print(json.dumps(out))
"""


def wheel_top_levels(wheel: Path) -> set[str]:
    """The top-level names a wheel installs into site-packages (its own .dist-info aside)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise AttnkitError(f"{wheel.name}: not a readable wheel ({type(exc).__name__})") from None
    tops = set()
    for n in names:
        parts = n.split("/")
        if parts[0].endswith(".dist-info"):
            continue
        if parts[0].endswith(".data"):
            if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                tops.add(parts[2])
            continue  # scripts, headers, data: outside site-packages
        tops.add(parts[0])
    return {t for t in tops if t}


def environment_state(python: str, tops: set[str], project: str) -> dict[str, object]:
    r = subprocess.run([python, "-c", _PROBE, json.dumps(sorted(tops)), canonicalize_name(project)],
                       capture_output=True, text=True, check=False)
    try:
        state = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        first = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise AttnkitError(f"--python {python}: cannot list its installed distributions ({first})") from None
    return dict(state)


def check_no_foreign_writes(wheel: Path, project: str, python: str) -> dict[str, str]:
    """Refuse a wheel that writes into a top-level package another installed distribution owns; returns the
    torch snapshot to compare after the install."""
    state = environment_state(python, wheel_top_levels(wheel), project)
    owners: dict[str, list[str]] = state["owners"]  # type: ignore[assignment]
    if owners:
        top, (dist, version) = sorted(owners.items())[0]
        more = f" (and {len(owners) - 1} more)" if len(owners) > 1 else ""
        raise AttnkitError(f"{wheel.name} would write into {top}/ of the installed {dist} {version}{more}: refusing; "
                           "a wheel must not change another package's files")
    return state["torch"]  # type: ignore[return-value]


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Files of torch's RECORD that differ; byte-code caches are derived (Python rewrites them itself)."""
    return sorted(p for p in before.keys() | after.keys()
                  if before.get(p) != after.get(p) and "__pycache__" not in Path(p).parts)


def torch_after(python: str, project: str) -> tuple[dict[str, str], list[str]]:
    """(torch's file snapshot, dist-info folders of `project` left without RECORD by a failed install)."""
    state = environment_state(python, set(), project)
    return state["torch"], state["half"]  # type: ignore[return-value]
