"""The data attnkit ships inside its package: matrix.yaml and the build recipes (recipes/<package>.toml).

They live here, not at the repository top (where `matrix.yaml` and `wheels/*.toml` are links to these files),
so every command reads the same facts from `pip install attnkit` as from a checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from attnkit.errors import AttnkitError

MATRIX = "matrix.yaml"
RECIPES = "recipes"


def packaged(*parts: str) -> Path:
    """A file shipped in attnkit.data, as a path (attnkit is installed unzipped: pip and uv always do)."""
    res = resources.files(__name__).joinpath(*parts)
    if not isinstance(res, Path):  # pragma: no cover - zipimport, which pip/uv never produce
        raise AttnkitError(f"attnkit's packaged {'/'.join(parts)} is inside an archive ({res}); install attnkit "
                           f"unzipped (pip or uv do), or pass --file / ATTNKIT_MATRIX")
    return res


def recipe_names() -> list[str]:
    return sorted(p.stem for p in packaged(RECIPES).glob("*.toml"))
