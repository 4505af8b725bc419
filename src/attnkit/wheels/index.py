"""A static PEP 503 simple index (per-file `#sha256=` and `data-requires-python`) plus one find-links page per
cell, ready for GitHub Pages or release hosting. Only verified wheels go in: each needs its
`<wheel>.verify.json`, passed, with the same sha256 as the file now."""

from __future__ import annotations

import hashlib
import html
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from attnkit.errors import AttnkitError
from attnkit.wheels.build import verification_path
from attnkit.wheels.retag import read_metadata


@dataclass(frozen=True)
class Entry:
    project: str
    filename: str
    sha256: str
    requires_python: str | None
    cell: str
    size_bytes: int


def collect(src: Path) -> list[Entry]:
    if not src.is_dir():
        raise AttnkitError(f"{src}: not a directory of wheels")
    wheels = sorted(src.glob("*.whl"))
    if not wheels:
        raise AttnkitError(f"{src}: no .whl files")
    entries = []
    for w in wheels:
        vp = verification_path(w)
        if not vp.is_file():
            raise AttnkitError(f"{w.name}: no verification report {vp.name}; run `attnkit wheels verify` first")
        try:
            rep = json.loads(vp.read_text())
        except ValueError:
            raise AttnkitError(f"{vp}: not valid JSON") from None
        if not rep.get("ok"):
            raise AttnkitError(f"{w.name}: its verification failed ({'; '.join(rep.get('problems', []))})")
        data = w.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        if sha != rep.get("sha256"):
            raise AttnkitError(f"{w.name}: sha256 {sha} is not the verified {rep.get('sha256')}; the file changed "
                               f"after verification")
        name = parse_wheel_filename(w.name)[0]
        rp = read_metadata(w).get("Requires-Python", [None])[0]
        entries.append(Entry(canonicalize_name(name), w.name, sha, rp, rep["cell"], len(data)))
    return entries


def _anchor(href: str, e: Entry) -> str:
    rp = f' data-requires-python="{html.escape(e.requires_python, quote=True)}"' if e.requires_python else ""
    return f'<a href="{html.escape(href, quote=True)}#sha256={e.sha256}"{rp}>{html.escape(e.filename)}</a><br/>'


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\">"
            f"<title>{html.escape(title)}</title></head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
            + "\n".join(body) + "\n</body></html>\n")


def build_index(src: Path, out: Path, base_url: str | None = None) -> list[Entry]:
    """Write the index to `out` (replaced as a whole). Without `base_url` the wheels are copied to
    out/files/ and linked relatively; with it, links point to `base_url + filename` (release assets)."""
    entries = collect(src)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        projects: dict[str, list[Entry]] = {}
        cells: dict[str, list[Entry]] = {}
        for e in entries:
            projects.setdefault(e.project, []).append(e)
            cells.setdefault(e.cell, []).append(e)
        if base_url is None:
            (stage / "files").mkdir()
            for e in entries:
                shutil.copyfile(src / e.filename, stage / "files" / e.filename)

        def href(e: Entry, depth: int) -> str:
            return f"{base_url.rstrip('/')}/{e.filename}" if base_url else "../" * depth + f"files/{e.filename}"

        simple = stage / "simple"
        simple.mkdir()
        (simple / "index.html").write_text(_page("Simple index", [f'<a href="{p}/">{p}</a><br/>' for p in sorted(projects)]))
        for p, es in projects.items():
            (simple / p).mkdir()
            (simple / p / "index.html").write_text(_page(f"Links for {p}", [_anchor(href(e, 2), e) for e in es]))
        (stage / "cells").mkdir()
        for c, es in cells.items():
            (stage / "cells" / f"{c}.html").write_text(_page(f"attnkit wheels for {c}",
                                                             [_anchor(href(e, 1), e) for e in es]))
        (stage / "index.json").write_text(json.dumps([asdict(e) for e in entries], indent=1))
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            out.replace(old)
        stage.replace(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return entries
