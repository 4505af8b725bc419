"""Pipeline stage 1, the source: the pinned sdist fetched once (sha256-checked) and unpacked into a build tree
that is kept between runs, so builds resume; and the digest that names the tree in compiled objects' keys."""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

from attnkit._progress import download
from attnkit.errors import AttnkitError
from attnkit.wheels.recipe import BuildSpec

IGNORED = ("build", "dist", "*.egg-info", "__pycache__")  # build outputs, never part of a source tree


def fetch_sdist(url: str, sha256: str, cache: Path) -> Path:
    """Download once into the cache; a file whose sha256 differs from matrix.yaml's is refused."""
    dest = cache / "sdists" / url.rsplit("/", 1)[-1]
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == sha256:
        return dest
    got_path = download(url, dest.with_name(dest.name + ".new"), f"sdist {dest.name}")
    got = hashlib.sha256(got_path.read_bytes()).hexdigest()
    if got != sha256:
        got_path.unlink(missing_ok=True)
        raise AttnkitError(f"sdist: {url} has sha256 {got}, matrix.yaml says {sha256}")
    got_path.replace(dest)
    return dest


def apply_patches(spec: BuildSpec, src: Path) -> None:
    """The recipe's source patches for this cell's torch, applied in place (each file rewritten through a temp
    file)."""
    for pt in spec.recipe.patches_for(spec.cell.torch_version):
        path = src / pt.file
        if not path.is_file():
            raise AttnkitError(f"recipe {spec.recipe_path}: patch of {pt.file}: no such file in the source tree")
        text = path.read_text(encoding="utf-8")
        n = text.count(pt.old)
        if n == 0:
            raise AttnkitError(f"recipe {spec.recipe_path}: patch of {pt.file} for torch{pt.torch}: {pt.old!r} "
                               f"is not there (upstream changed: update or drop the patch)")
        tmp = path.with_name(path.name + ".attnkit-tmp")
        tmp.write_text(text.replace(pt.old, pt.new), encoding="utf-8")
        shutil.copymode(path, tmp)
        tmp.replace(path)


def prepare_source(spec: BuildSpec, build_dir: Path, cache: Path) -> Path:
    """The source tree to build in, with the recipe's patches for this cell. Kept between runs (with its
    build/ objects) so builds resume."""
    src = build_dir / "src"
    if spec.local_source is not None:
        # copy2 keeps the sources' mtimes, so ninja still sees earlier objects as up to date; a patched file
        # whose result is what the tree already held keeps its time too (the copy put the unpatched text back)
        patched = [src / pt.file for pt in spec.recipe.patches_for(spec.cell.torch_version)]
        before = {p: (p.read_bytes(), p.stat()) for p in patched if p.is_file()}
        shutil.copytree(spec.local_source, src, dirs_exist_ok=True, copy_function=shutil.copy2,
                        ignore=shutil.ignore_patterns(*IGNORED))
        apply_patches(spec, src)
        for path, (data, st) in before.items():
            if path.read_bytes() == data:
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return src
    assert spec.sdist_url and spec.sdist_sha256
    marker = build_dir / ".source-digest"  # what the unpacked tree is (source_digest)
    if src.is_dir() and marker.is_file() and marker.read_text().strip() == source_digest(spec):
        return src
    archive = fetch_sdist(spec.sdist_url, spec.sdist_sha256, cache)
    tmp = build_dir / "src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    tops = [p for p in tmp.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise AttnkitError(f"sdist: {archive.name} does not unpack to one folder")
    shutil.rmtree(src, ignore_errors=True)
    apply_patches(spec, tops[0])
    tops[0].replace(src)
    shutil.rmtree(tmp, ignore_errors=True)
    marker.write_text(source_digest(spec) + "\n")
    return src


def source_digest(spec: BuildSpec) -> str:
    """What the source tree is: the sdist's sha256 (it covers every header), or for a local source the hash
    of every file's path and bytes (build outputs left out); and the recipe's patches for this cell, which
    change what is compiled. Part of every object key (wheels/shards.py) and the unpacked tree's marker."""
    import fnmatch

    if spec.sdist_sha256:
        base = spec.sdist_sha256
    else:
        assert spec.local_source is not None
        root = spec.local_source
        h = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root)
            if any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in IGNORED):
                continue
            h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
        base = h.hexdigest()
    patches = [pt.model_dump() for pt in spec.recipe.patches_for(spec.cell.torch_version)]
    return base + (f" patches:{hashlib.sha256(repr(patches).encode()).hexdigest()[:16]}" if patches else "")
