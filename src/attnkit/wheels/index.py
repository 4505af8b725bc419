"""The wheel site: ONE pip index per environment key, the way PyTorch serves one index per CUDA.

    SITE/index.html, keys.json              landing page: every key, its CUDA/torch/ABI, the install commands
    SITE/<key>/simple/<project>/index.html  PEP 503, sha256, Requires-Python, PEP 658/714 metadata
    SITE/cells/<cell>.html                  one find-links page per cell
    SITE/files/<wheel>[.metadata]           the wheels (unless --base-url) and their METADATA (PEP 658)

    SITE/stable/simple/<project>/index.html every stable-ABI wheel, whatever key (`attnkit install` reads it to
                                            say why an environment below a wheel's torch floor gets none)

A stable-ABI wheel (local label 'cu13torch2.9stable.sm90', naming.stable_local_version) is listed under every
key it serves: each key of the matrix's torch releases (and of the other wheels indexed) with its CUDA major
and a torch at or above its floor; Python is its abi3 tag's business (cp39-abi3: every CPython >= 3.9).

The key is the wheels' local version label (naming.index_key). No flat index over all keys is written:
PEP 440 orders local labels segment by segment as text, so pip and uv pick torch2.9's wheel over torch2.11's
there (and downgrade torch). Only verified wheels go in: each needs its `<wheel>.verify.json`, passed, with
the same sha256 as the file now.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import tempfile
import urllib.parse
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from attnkit.errors import AttnkitError, UsageError
from attnkit.matrix import naming
from attnkit.matrix.schema import Matrix
from attnkit.wheels.accept import verification_path
from attnkit.wheels.retag import metadata_bytes, parse_metadata

PYPI = "https://pypi.org/simple"


@dataclass(frozen=True)
class Entry:
    project: str
    filename: str
    version: str
    key: str
    sha256: str
    metadata_sha256: str
    requires_python: str | None
    cell: str
    size_bytes: int


def local_label(filename: str) -> str:
    """The local version label exactly as the file names it ('cu13torch2.11cxx11abiTRUE'): the index key."""
    version = filename.split("-")[1]
    return version.partition("+")[2]


SITE_MARKER = ".attnkit-site"  # in every site `index build` writes: the only kind of folder it replaces
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}", flags=re.ASCII)  # a cell id, a key: one path part


def _safe_part(value: object, what: str, where: str) -> str:
    """A name read from a file, checked before it becomes part of a path (no '/', '..', or control chars)."""
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value) or ".." in value:
        raise AttnkitError(f"{where}: {what} {str(value)[:80]!r} is not a plain name (letters, digits, '.', '_', "
                           "'+', '-'; no '/' or '..')")
    return value


def check_base_url(base_url: str | None, option: str = "--base-url",
                   example: str = "https://github.com/ORG/REPO/releases/download/TAG/") -> str | None:
    """--base-url / --site-url must be an http(s) URL: it is written into the site's links and keys.json."""
    if base_url is None:
        return None
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc or any(c in base_url for c in "\"\'<> \n\r\t"):
        raise UsageError(f"{option}: {base_url[:80]!r} is not an http(s) URL (e.g. {example})")
    return base_url


def check_out(src: Path, out: Path) -> None:
    """Refuse an --out that would destroy what is not a site of ours, or that overlaps the wheel folder."""
    if out.is_symlink():  # checked before resolving: a link's target is some other folder, written or replaced
        raise UsageError(f"--out: {out} is a symbolic link; give the folder itself")
    src, out = src.resolve(), out.resolve()
    if out == src or out in src.parents or src in out.parents:
        raise UsageError(f"--out: {out} overlaps the wheel folder {src}; give a folder of its own (e.g. {src.parent / 'site'})")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"--out: {out} exists and is not a folder; give a new folder or a site attnkit wrote")
    if out.is_dir() and any(out.iterdir()) and not (out / SITE_MARKER).is_file():
        raise UsageError(f"--out: {out} is a folder with files that attnkit did not write (no {SITE_MARKER}); "
                         "give an empty or new folder, or a site written by `attnkit index build`")


def _clean_stale_stages(out: Path, keep: Path) -> None:
    """Stage folders a killed run left beside `out` (marked as ours, so nothing else is touched)."""
    for stale in out.parent.glob(f".{out.name}.*"):
        if stale != keep and stale.is_dir() and not stale.is_symlink() and (stale / SITE_MARKER).is_file():
            shutil.rmtree(stale, ignore_errors=True)


def _report(vp: Path) -> dict[str, object]:
    try:
        rep = json.loads(vp.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise AttnkitError(f"{vp}: not valid JSON (or nested too deeply)") from None
    except OSError as exc:
        raise AttnkitError(f"{vp}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if not isinstance(rep, dict):
        raise AttnkitError(f"{vp}: not a verification report (expected a JSON object)")
    problems = rep.get("problems", [])
    if not isinstance(problems, list) or not all(isinstance(x, str) for x in problems):
        raise AttnkitError(f"{vp}: 'problems' must be a list of strings")
    if not isinstance(rep.get("ok"), bool):
        raise AttnkitError(f"{vp}: 'ok' must be true or false, is {rep.get('ok')!r}")
    _safe_part(rep.get("cell"), "cell", str(vp))
    return rep


def collect(src: Path) -> list[Entry]:
    if not src.is_dir():
        raise AttnkitError(f"{src}: not a directory of wheels")
    wheels = sorted(w for w in src.glob("*.whl") if not w.name.startswith("."))
    if not wheels:
        raise AttnkitError(f"{src}: no .whl files")
    entries = []
    for w in wheels:
        if not w.is_file() or w.is_symlink():
            raise AttnkitError(f"{w}: not a wheel file (a folder or a link)")
        vp = verification_path(w)
        if not vp.is_file():
            raise AttnkitError(f"{w.name}: no verification report {vp.name}; run `attnkit wheels verify` first")
        rep = _report(vp)
        if not rep["ok"]:
            raise AttnkitError(f"{w.name}: its verification failed ({'; '.join(rep.get('problems', []))})")  # type: ignore[arg-type]
        data = w.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        if sha != rep.get("sha256"):
            raise AttnkitError(f"{w.name}: sha256 {sha} is not the verified {rep.get('sha256')}; the file changed "
                               f"after verification")
        try:
            name, version, _, _ = parse_wheel_filename(w.name)
        except (InvalidWheelFilename, InvalidVersion) as exc:
            raise AttnkitError(f"{w.name}: not a valid wheel file name ({exc})") from None
        key = local_label(w.name)
        if key:
            _safe_part(key, "local version label", w.name)
            if not naming.is_pipeline_label(key):
                raise AttnkitError(f"{w.name}: +{key} is not a label attnkit's pipeline writes "
                                   "(cu13torch2.11cxx11abiTRUE, optionally .sm90 or .trim<hash>, or a stable-ABI "
                                   "cu13torch2.9stable.sm80sm90); index keys come only from those")
            if naming.parse_stable_local(naming.untrimmed(key)) is not None and "abi3" not in w.name.rsplit("-", 2)[-2]:
                raise AttnkitError(f"{w.name}: a stable-ABI label (+{key}) on a wheel not tagged abi3; only "
                                   "limited-API wheels serve several torch minors")
        if not key:
            raise AttnkitError(f"{w.name}: no local version label (+cu13torch2.11cxx11abiTRUE); only wheels named by "
                               f"attnkit's pipeline are indexed, one index per label")
        try:
            meta = metadata_bytes(w)
            rp = parse_metadata(meta).get("Requires-Python", [None])[0]
        except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, OSError) as exc:
            raise AttnkitError(f"{w.name}: not a readable wheel ({type(exc).__name__}: {str(exc)[:120]})") from None
        meta_sha = hashlib.sha256(meta).hexdigest()
        entries.append(Entry(canonicalize_name(name), w.name, str(version), key, sha, meta_sha, rp, str(rep["cell"]),
                             len(data)))
    return entries


STABLE_DIR = "stable"  # SITE/stable/simple/: every stable-ABI wheel


def served_keys(label: str, matrix: Matrix | None, other_keys: set[str]) -> list[str]:
    """The index keys a stable-ABI wheel labelled `label` is listed under: of the matrix's torch releases (every
    CUDA each ships) and of the other wheels being indexed, those naming.stable_serves says it serves."""
    cands = set(other_keys)
    if matrix is not None:
        for minor, rel in matrix.torch.items():
            for cuda in rel.all_cuda():
                cands.add(naming.index_key(cuda, minor, rel.cxx11_abi))
    return sorted((k for k in cands if naming.stable_serves(label, k)),
                  key=lambda k: naming.parse_local_version(k) or ("", "0.0", True))


def expand_stable(entries: list[Entry], matrix: Matrix | None) -> list[Entry]:
    """Per-key entries: a stable-ABI wheel once under each key it serves (it must serve one)."""
    import dataclasses

    cell_keys = {e.key for e in entries if naming.parse_stable_local(e.key) is None}
    out = []
    for e in entries:
        if naming.parse_stable_local(e.key) is None:
            out.append(e)
            continue
        keys = served_keys(e.key, matrix, cell_keys)
        if not keys:
            cuda, floor, _ = naming.parse_stable_local(e.key) or ("?", "?", ())
            raise AttnkitError(f"{e.filename}: serves no index key: no torch >= {floor} with CUDA {cuda[2:]}.x in the "
                               f"matrix{'' if matrix is not None else ' (none given)'} or among the wheels indexed")
        out.extend(dataclasses.replace(e, key=k) for k in keys)
    return out


def install_commands(index_url: str, project: str, version: str | None = None) -> dict[str, str]:
    """How a user installs `project` from one key's index, with pip and with uv. Dependencies (einops, ...)
    come from PyPI. pip merges both indexes and takes the highest version: ours carries a local label, so it
    outranks the same release on PyPI, and the pin keeps a newer PyPI release (an sdist) out. uv takes a
    package from the first index that has it (its --index before the default), so it never looks past ours."""
    req = f"{project}=={version}" if version else project
    return {
        "pip": f"pip install {req} --index-url {index_url} --extra-index-url {PYPI}",
        "uv": f"uv pip install {req} --index {index_url}",
    }


def _href(e: Entry, depth: int, base_url: str | None) -> str:
    quoted = urllib.parse.quote(e.filename)  # '+' -> '%2B': some servers read a raw '+' in a path as a space
    return f"{base_url.rstrip('/')}/{quoted}" if base_url else "../" * depth + f"files/{quoted}"


def _anchor(e: Entry, depth: int, base_url: str | None) -> str:
    attrs = [f'href="{html.escape(_href(e, depth, base_url), quote=True)}#sha256={e.sha256}"']
    if e.requires_python:
        attrs.append(f'data-requires-python="{html.escape(e.requires_python, quote=True)}"')
    attrs.append(f'data-dist-info-metadata="sha256={e.metadata_sha256}"')  # PEP 658 (pip < 23.3 reads this one)
    attrs.append(f'data-core-metadata="sha256={e.metadata_sha256}"')  # PEP 714
    return f"<a {' '.join(attrs)}>{html.escape(e.filename)}</a><br/>"


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\">"
            f"<title>{html.escape(title)}</title></head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _key_facts(key: str) -> dict[str, object]:
    parsed = naming.parse_local_version(key)
    if parsed is None:  # a test build for fewer archs ('...TRUE.sm90'): its own key
        return {"cuda": None, "torch": None, "cxx11_abi": None}
    cuda, torch, abi = parsed
    return {"cuda": cuda, "torch": torch, "cxx11_abi": abi}


def _landing(keys: dict[str, list[Entry]], site_url: str | None) -> tuple[str, list[dict[str, object]]]:
    rows, table = [], []
    for key in sorted(keys):
        es = keys[key]
        url = naming.simple_index_url(site_url, key) if site_url else f"{key}/simple/"
        projects = sorted({e.project for e in es})
        facts = _key_facts(key)
        newest = {p: max(Version(e.version) for e in es if e.project == p).public for p in projects}
        cmds = {p: install_commands(url, p, newest[p]) for p in projects}
        table.append({"key": key, **facts, "index_url": url, "projects": projects,
                      "cells": sorted({e.cell for e in es}), "commands": cmds})
        lines = "<br/>".join(f"<code>{html.escape(c)}</code>" for p in projects for c in cmds[p].values())
        rows.append(f'<tr><td><a href="{html.escape(key)}/simple/">{html.escape(key)}</a></td>'
                    f"<td>{facts['cuda'] or '-'}</td><td>{facts['torch'] or '-'}</td>"
                    f"<td>{html.escape(', '.join(projects))}</td><td>{lines}</td></tr>")
    body = ["<p>One pip index per environment key: <code>attnkit index key</code> prints yours "
            "(CUDA major, torch major.minor, C++11 ABI of the installed torch).</p>",
            "<table><tr><th>key</th><th>CUDA</th><th>torch</th><th>projects</th><th>install</th></tr>",
            *rows, "</table>"]
    return _page("attnkit wheels", body), table


def build_index(src: Path, out: Path, base_url: str | None = None, site_url: str | None = None,
                matrix: Matrix | None = None) -> list[Entry]:
    """Write the site to `out` (replaced as a whole, never half-written). Without `base_url` the wheels are
    copied to out/files/ and linked relatively; with it, links point to `base_url + filename` (release assets),
    and the `.metadata` files in out/files/ must be uploaded beside them (PEP 658 puts them at the wheel's URL
    + '.metadata'). `site_url`: where the site will be served, for absolute URLs in the landing page.
    `matrix`: its torch releases are keys a stable-ABI wheel is listed under. Returns one entry per key."""
    base_url = check_base_url(base_url)
    site_url = check_base_url(site_url or None, "--site-url", "https://ORG.github.io/REPO/")  # "": relative links
    check_out(src, out)
    found = collect(src)
    entries = expand_stable(found, matrix)
    out = out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        stage.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the site from a web server running as another user
    except OSError as exc:
        raise AttnkitError(f"--out: {out}: cannot be written ({exc.strerror or type(exc).__name__})") from None
    try:
        (stage / SITE_MARKER).write_text("written by attnkit index build; replaced as a whole by the next build\n")
        _clean_stale_stages(out, stage)
        keys: dict[str, list[Entry]] = {}
        cells: dict[str, list[Entry]] = {}
        for e in entries:
            keys.setdefault(e.key, []).append(e)
        for e in found:
            cells.setdefault(e.cell, []).append(e)
        files = stage / "files"
        files.mkdir()
        for e in found:
            if base_url is None:
                shutil.copyfile(src / e.filename, files / e.filename)
            (files / f"{e.filename}.metadata").write_bytes(metadata_bytes(src / e.filename))
        for key, es in keys.items():
            simple = stage / key / "simple"
            simple.mkdir(parents=True)
            projects: dict[str, list[Entry]] = {}
            for e in es:
                projects.setdefault(e.project, []).append(e)
            (simple / "index.html").write_text(_page(f"Simple index {key}",
                                                     [f'<a href="{p}/">{p}</a><br/>' for p in sorted(projects)]))
            for p, pes in projects.items():
                (simple / p).mkdir()
                (simple / p / "index.html").write_text(_page(f"Links for {p} ({key})",
                                                             [_anchor(e, 3, base_url) for e in pes]))
        stable = [e for e in found if naming.parse_stable_local(e.key) is not None]
        for p in sorted({e.project for e in stable}):
            (stage / STABLE_DIR / "simple" / p).mkdir(parents=True)
            (stage / STABLE_DIR / "simple" / p / "index.html").write_text(_page(
                f"Stable-ABI wheels of {p} (every key they serve is listed at the root)",
                [_anchor(e, 3, base_url) for e in stable if e.project == p]))
        (stage / "cells").mkdir()
        for c, es in cells.items():
            (stage / "cells" / f"{c}.html").write_text(_page(f"attnkit wheels for {c}",
                                                             [_anchor(e, 1, base_url) for e in es]))
        landing, table = _landing(keys, site_url)
        (stage / "index.html").write_text(landing)
        (stage / "keys.json").write_text(json.dumps(table, indent=1))
        (stage / "index.json").write_text(json.dumps([asdict(e) for e in entries], indent=1))
        old = None
        if out.exists():  # check_out made sure it is empty or a site of ours; swapped out, never merged into
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            out.replace(old)
        stage.replace(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return entries
