"""The source tree an image is built from. An image bakes in attnkit's own wheel, the Dockerfile and the
noxfile its smoke stage runs, so image commands need an attnkit checkout, wherever attnkit itself is installed."""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError

MARKERS = ("docker/Dockerfile", "docker/docker-bake.hcl", "noxfile.py", "pyproject.toml")


def _is_checkout(path: Path) -> bool:
    return all((path / m).is_file() for m in MARKERS)


def source_tree(path: str | Path | None = None) -> Path:
    """`path` if given; else the checkout this attnkit runs from (an editable install); else the current
    directory. One-line error when it is not an attnkit checkout."""
    if path is not None:
        p = Path(path).resolve()
        if not _is_checkout(p):
            raise AttnkitError(f"--context {p}: not an attnkit checkout (needs {', '.join(MARKERS)})")
        return p
    for p in (Path(__file__).resolve().parents[3], Path.cwd()):
        if _is_checkout(p):
            return p
    raise AttnkitError("images: run from an attnkit checkout (git clone https://github.com/attnkit/attnkit) or pass "
                       f"--context DIR; an image is built from its {', '.join(MARKERS)}")
