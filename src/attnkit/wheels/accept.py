"""Pipeline stage 4, acceptance: a freshly built wheel gets its published name and torch pin (retag), is
verified, and only then moves into the wheelhouse with its verification report. The native driver, the
sharded link job, cibuildwheel's repair step, `wheels verify --accept-to`, the index and the images all
accept wheels through this module."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from attnkit.errors import AttnkitError
from attnkit.wheels.recipe import BuildSpec


def finalize(built: Path, spec: BuildSpec, out: Path, *, python: str = sys.executable, machine: str | None = None,
             verify: bool = True, also: tuple[str, ...] = ()) -> tuple[Path, dict[str, Any] | None]:
    """A freshly built wheel -> its published name and torch pin (retag) -> verified -> moved into `out`.
    Shared by the native driver and cibuildwheel's repair step, so both accept wheels the same way."""
    import platform
    import tempfile

    from attnkit.wheels.retag import retag

    cell = spec.cell
    assert cell.cuda is not None
    filename = spec.wheel_filename(machine or platform.machine())
    with tempfile.TemporaryDirectory(prefix="attnkit-stage-") as tmp:
        staged = retag(built, Path(tmp), filename, cell.torch, spec.torch_requirement())
        if not verify:
            return accept(staged, out, None), None
        from attnkit.wheels.verify import verify_wheel

        vr = verify_wheel(staged, spec, python=python, also=also)
        if not vr.ok:
            raise AttnkitError(f"verify: {staged.name} rejected: {'; '.join(vr.problems)}")
        return accept(staged, out, vr.to_dict()), vr.to_dict()

def verification_path(wheel: Path) -> Path:
    """Where a wheel's verification report lives: next to it, `<wheel>.verify.json`."""
    return wheel.with_name(wheel.name + ".verify.json")

def accept(staged: Path, out: Path, verification: dict[str, Any] | None) -> Path:
    """Move a verified wheel into the output directory: temp name + rename, report first, so `out` never
    holds a half-written wheel or a wheel without its report."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / staged.name
    if verification is not None:
        from attnkit._io import write_atomic

        write_atomic(verification_path(final), json.dumps(verification, indent=1))
    tmp = out / f".{staged.name}.tmp"
    shutil.copyfile(staged, tmp)
    tmp.replace(final)
    return final
