"""Pipeline stage 1, the source: the pinned sdist fetched once (sha256-checked) and unpacked into a build tree
that is kept between runs, so builds resume; and the digest that names the tree in compiled objects' keys."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
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


ENV_GIT_MIRRORS = "ATTNKIT_GIT_MIRRORS"  # a folder of bare mirrors: OWNER/NAME.git or OWNER+NAME/repo


def _git(*args: str, what: str) -> subprocess.CompletedProcess[bytes]:
    r = subprocess.run(["git", *args], capture_output=True, check=False)
    if r.returncode != 0:
        last = (r.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise AttnkitError(f"git source: {what}: {last[:300]}")
    return r


def git_repo(url: str, commit: str, cache: Path) -> Path:
    """A bare repository holding `commit` of `url`: a mirror from $ATTNKIT_GIT_MIRRORS where it has the
    commit, else attnkit's cache, fetched once (`git fetch --depth 1 URL COMMIT`; GitHub serves any commit)."""
    if shutil.which("git") is None:
        raise AttnkitError("git source: git is not installed (a package pinned by commit needs it)")
    owner_name = url.removesuffix(".git").rstrip("/").split("/")[-2:]
    mirrors = os.environ.get(ENV_GIT_MIRRORS)
    if mirrors and len(owner_name) == 2:
        o, n = owner_name
        for cand in (Path(mirrors) / o / f"{n}.git", Path(mirrors) / f"{o}+{n}" / "repo"):
            if cand.is_dir() and subprocess.run(["git", "--git-dir", str(cand), "cat-file", "-e", f"{commit}^{{commit}}"],
                                                capture_output=True).returncode == 0:
                return cand
    repo = cache / "git" / hashlib.sha256(url.encode()).hexdigest()[:16]
    if not (repo / "HEAD").is_file():
        repo.mkdir(parents=True, exist_ok=True)
        _git("init", "--quiet", "--bare", str(repo), what=f"init {repo}")
    have = subprocess.run(["git", "--git-dir", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if have.returncode != 0:
        _git("--git-dir", str(repo), "fetch", "--quiet", "--depth", "1", url, commit, what=f"fetch {commit} of {url}")
    return repo


def _extract(repo: Path, commit: str, paths: list[str], dest: Path, what: str) -> None:
    """`git archive COMMIT -- PATHS` unpacked into dest (no .git: the tree as the commit has it)."""
    dest.mkdir(parents=True, exist_ok=True)
    arch = _git("--git-dir", str(repo), "archive", "--format=tar", commit, "--", *paths, what=f"archive {what}")
    with tarfile.open(fileobj=io.BytesIO(arch.stdout)) as tar:
        tar.extractall(dest, filter="data")


def prepare_git(spec: BuildSpec, tree: Path, cache: Path) -> None:
    """The pinned commit's tree (its `paths`), and each submodule at its pinned commit, which must be the commit
    the superproject records for that path (so the pin is upstream's, not a guess)."""
    g = spec.git
    assert g is not None
    repo = git_repo(g.url, g.commit, cache)
    _extract(repo, g.commit, list(g.paths), tree, f"{g.url}@{g.commit[:12]}")
    for path, sub in g.submodules.items():
        ls = _git("--git-dir", str(repo), "ls-tree", g.commit, "--", path, what=f"submodule {path}").stdout.decode()
        recorded = ls.split()[2] if ls.split()[1:2] == ["commit"] else None
        if recorded != sub.commit:
            raise AttnkitError(f"git source: {g.url}@{g.commit[:12]} records {path} at {recorded or 'no submodule'}, "
                               f"matrix.yaml pins {sub.commit}: pin the commit upstream records")
        srepo = git_repo(sub.url, sub.commit, cache)
        _extract(srepo, sub.commit, list(sub.paths), tree / path, f"{sub.url}@{sub.commit[:12]}")


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
    marker = build_dir / ".source-digest"  # what the unpacked tree is (source_digest)
    sub = spec.git.subdir if spec.git and spec.git.subdir else ""
    if src.is_dir() and marker.is_file() and marker.read_text().strip() == source_digest(spec):
        return src / sub if sub else src
    if spec.git is not None:
        tmp = build_dir / "src.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        prepare_git(spec, tmp, cache)
        if sub and not (tmp / sub / "setup.py").is_file():
            raise AttnkitError(f"git source: {sub}/setup.py is not in {spec.git.url}@{spec.git.commit[:12]}")
        apply_patches(spec, tmp / sub if sub else tmp)
        shutil.rmtree(src, ignore_errors=True)
        tmp.replace(src)
        marker.write_text(source_digest(spec) + "\n")
        return src / sub if sub else src
    assert spec.sdist_url and spec.sdist_sha256
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
    elif spec.git is not None:  # a commit names its tree; the parts taken of it are part of what is built
        g = spec.git
        parts = [f"{g.url}@{g.commit}:{','.join(g.paths)}"] + [f"{p}={s.url}@{s.commit}:{','.join(s.paths)}"
                                                               for p, s in sorted(g.submodules.items())]
        base = "git:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()
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
