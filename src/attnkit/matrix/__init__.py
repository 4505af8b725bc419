"""matrix.yaml: load and validate (schema), expand into cells (expand), name things (naming), emit (emit)."""

from attnkit.matrix.expand import Cell, CellFilter, expand
from attnkit.matrix.load import DEFAULT_MATRIX, load_matrix
from attnkit.matrix.schema import Matrix

__all__ = ["DEFAULT_MATRIX", "Cell", "CellFilter", "Matrix", "expand", "load_matrix"]
