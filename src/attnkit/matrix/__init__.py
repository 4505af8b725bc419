"""matrix.yaml: load and validate (schema), expand into cells (expand), name things (naming), emit (emit)."""

from attnkit.matrix.expand import Cell, CellFilter, expand
from attnkit.matrix.load import default_matrix_path, load_matrix
from attnkit.matrix.schema import Matrix

__all__ = ["Cell", "CellFilter", "Matrix", "default_matrix_path", "expand", "load_matrix"]
