"""Read matrix.yaml into a validated `Matrix`, turning every failure into ONE line that names the file,
the field, its line where known, and what is allowed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError

from attnkit import data
from attnkit.errors import AttnkitError, shown
from attnkit.matrix.schema import Matrix, problems

Path_ = tuple[str | int, ...]

ENV_MATRIX = "ATTNKIT_MATRIX"


def default_matrix_path() -> Path:
    """$ATTNKIT_MATRIX, else the matrix.yaml shipped inside attnkit (the checkout's top-level matrix.yaml is a
    link to that same file)."""
    env = os.environ.get(ENV_MATRIX)
    return Path(env) if env else data.packaged(data.MATRIX)


MAX_DEPTH = 32  # matrix.yaml nests 6 deep; a deeper file is a mistake or an attack (the composer recurses)


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML would silently keep the last one), keys that are not plain
    scalars (`? [a, b]`), anchors and aliases (an alias bomb of a few hundred bytes expands to gigabytes; a
    matrix has no use for them) and nesting deeper than MAX_DEPTH (5000 `[` would exhaust Python's stack)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            _refuse(f"aliases (*{event.anchor}) are not allowed in a matrix file; write the value out", event)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            _refuse(f"anchors (&{anchor}) are not allowed in a matrix file; write each value out", event)
        if self._depth >= MAX_DEPTH:
            _refuse(f"nested deeper than {MAX_DEPTH} levels; allowed: at most {MAX_DEPTH} (matrix.yaml nests 6)", event)
        self._depth += 1
        try:
            return super().compose_node(parent, index)  # type: ignore[no-untyped-call,no-any-return]
        finally:
            self._depth -= 1


def _refuse(problem: str, event: yaml.Event) -> NoReturn:
    raise yaml.composer.ComposerError(None, None, problem, event.start_mark)  # type: ignore[arg-type]


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain string (got a list or mapping as a key)", key_node.start_mark)
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_index(node: yaml.Node | None, path: Path_ = (), out: dict[Path_, int] | None = None) -> dict[Path_, int]:
    """Map every key path to its 1-based line in the file."""
    out = {} if out is None else out
    if node is None:
        return out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = (*path, str(key_node.value))
            out[child] = key_node.start_mark.line + 1
            _line_index(value_node, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_index(item, (*path, i), out)
    return out


def _nearest_line(lines: dict[Path_, int], loc: Path_) -> int | None:
    for cut in range(len(loc), -1, -1):
        key = tuple(str(p) if not isinstance(p, int) else p for p in loc[:cut])
        if key in lines:
            return lines[key]
    return None


def _shown(text: str) -> str:
    """A key as an error shows it: as written when printable, else quoted with escapes (never a raw newline)."""
    return text if text.isprintable() else repr(text)


def _one_line(text: str) -> str:
    return " ".join(text.split("\n")) if "\n" in text else text


def _dotted(loc: Path_) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        else:
            parts.append(("." if parts else "") + _shown(str(p)))
    return "".join(parts) or "(top level)"


def _explain(err: dict[str, Any]) -> str:
    """Rephrase pydantic's message into what is allowed."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling"
    if kind == "missing":
        return "required field is missing"
    if kind == "string_type" and isinstance(value, float):
        return f"got the number {value!r}; quote versions in YAML (e.g. \"2.10\", since 2.10 reads as 2.1)"
    if kind == "literal_error":
        return f"got {value!r}; allowed: {ctx.get('expected', '?')}"
    if kind in ("string_type", "bool_type", "list_type", "dict_type", "int_type", "model_type"):
        expected = {"string_type": "a string", "bool_type": "true or false", "list_type": "a list",
                    "dict_type": "a mapping", "int_type": "an integer", "model_type": "a mapping"}[kind]
        return f"expected {expected}, got {type(value).__name__} {value!r}"
    if kind == "too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return f"got {value!r}; must match {ctx.get('pattern')}"
    msg = str(err.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")


def format_validation_error(source: str, exc: ValidationError, lines: dict[Path_, int]) -> str:
    errors = exc.errors(include_url=False)
    first: dict[str, Any] = dict(errors[0])
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    line = _nearest_line(lines, loc)
    where = f"{source}:{line}" if line else source
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}: {_dotted(loc)}: {_explain(first)}{more}"


def parse_matrix(text: str, source: str) -> Matrix:
    """Validate matrix text; `source` names it in errors."""
    if not text.strip():
        raise AttnkitError(f"{source}: file is empty; expected a mapping with schema_version, torch, cuda, ...")
    loader: _LineLoader | None = None
    try:
        loader = _LineLoader(text)  # its reader refuses control characters here, at once
        node = loader.get_single_node()  # type: ignore[no-untyped-call]
        data = loader.construct_document(node) if node is not None else None  # type: ignore[no-untyped-call]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise AttnkitError(_one_line(f"{source}{line}: YAML syntax error: {exc.problem or exc.context}")) from None
    except yaml.YAMLError as exc:
        raise AttnkitError(f"{source}: YAML error: {(str(exc).splitlines() or ['?'])[0]}") from None
    except (ValueError, OverflowError, TypeError) as exc:  # a scalar PyYAML resolves but cannot build (a 5000-digit
        # int, 2024-02-30 read as a date, !!int "abc"): every value attnkit reads is a string or a small number
        raise AttnkitError(_one_line(f"{source}: a value cannot be read ({exc}); quote versions and dates as "
                                     "strings")) from None
    finally:
        if loader is not None:
            loader.dispose()  # type: ignore[no-untyped-call]
    if data is None:
        raise AttnkitError(f"{source}: file is empty (no YAML content); expected a mapping with schema_version, torch, cuda, ...")
    if not isinstance(data, dict):
        raise AttnkitError(f"{source}:1: expected a mapping at the top level, got {type(data).__name__}")
    lines = _line_index(node)
    try:
        m = Matrix.model_validate(data)
    except ValidationError as exc:
        raise AttnkitError(_one_line(format_validation_error(source, exc, lines))) from None
    found = problems(m) or _cell_problems(m)
    if found:
        loc, msg = found[0]
        at = _nearest_line(lines, loc)
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise AttnkitError(_one_line(f"{source}{f':{at}' if at else ''}: {_dotted(loc)}: {msg}{more}"))
    return m


def _cell_problems(m: Matrix) -> list[tuple[Path_, str]]:
    """What only the expanded cells show: the build rules produce some cell, and the reference cell (the one
    `latest` is tagged on and the machine we test on) is one of them."""
    from attnkit.matrix.expand import all_cells

    cells = all_cells(m)
    if not any(c.cuda is not None for c in cells):
        return [(("build",), "the build rules produce no CUDA cell; check build.python and build.exclude")]
    ref = m.reference_cell
    if not any((c.torch, c.cuda, c.python) == (ref.torch, ref.cuda, ref.python) for c in cells):
        return [(("reference_cell",), f"torch {ref.torch}, CUDA {ref.cuda}, Python {ref.python} is not a cell the "
                 "build rules produce (no image would carry the latest tag); add it to build.include or pick a "
                 "built cell")]
    return []


MAX_BYTES = 4 * 2**20


def load_matrix(path: str | Path | None = None) -> Matrix:
    """Load and validate a matrix file (default: $ATTNKIT_MATRIX, else the packaged matrix.yaml)."""
    p = Path(path) if path is not None else default_matrix_path()
    name = shown(p)
    try:
        with p.open("rb") as f:  # bounded: a device or a huge file is not a matrix
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise AttnkitError(f"{name}: larger than {MAX_BYTES // 2**20} MiB; a matrix.yaml is a few KiB of YAML")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise AttnkitError(f"{name}: no such file; pass --file PATH to a matrix.yaml") from None
    except IsADirectoryError:
        raise AttnkitError(f"{name}: is a directory; pass --file PATH to a matrix.yaml") from None
    except UnicodeDecodeError:
        raise AttnkitError(f"{name}: not UTF-8 text; matrix.yaml must be a UTF-8 YAML file") from None
    except OSError as exc:
        raise AttnkitError(f"{name}: cannot read ({exc.strerror or exc})") from None
    return parse_matrix(text, name)
