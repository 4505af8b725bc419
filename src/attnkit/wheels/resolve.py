"""Find the wheel that fits an environment in an index (`attnkit wheel-url`) and install it with its hash
checked (`attnkit install`). What fits is computed by the naming module from the environment's torch,
CUDA major, C++11 ABI, Python and machine: the same function that named the wheel when it was built."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.wheels.pyenv import PyEnv


@dataclass(frozen=True)
class Candidate:
    filename: str
    url: str  # without the #sha256 fragment
    sha256: str | None
    version: Version

    @property
    def local(self) -> str:
        return self.version.local or ""

    @property
    def tags(self) -> set[str]:
        return {str(t) for t in parse_wheel_filename(self.filename)[3]}


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _index_url(index: str) -> str:
    if "://" not in index:
        return Path(index).resolve().as_uri()
    return index


def listing(index: str, project: str) -> list[Candidate]:
    """Wheels of `project` in a PEP 503 index (URL, file:// URL or local directory)."""
    page = f"{_index_url(index).rstrip('/')}/{canonicalize_name(project)}/"
    target = page + "index.html" if page.startswith("file:") else page
    try:
        with urllib.request.urlopen(target, timeout=60) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError as exc:
        raise AttnkitError(f"--index {index}: cannot read {target} ({exc})") from None
    parser = _Links()
    parser.feed(text)
    out = []
    for href in parser.hrefs:
        url, _, frag = urllib.parse.urljoin(page, href).partition("#")
        fname = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        if not fname.endswith(".whl"):
            continue
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
        out.append(Candidate(fname, url, sha, parse_wheel_filename(fname)[1]))
    return out


def wanted(env: PyEnv) -> tuple[str, set[str]]:
    """(local version, acceptable tags) for an environment; the local version comes from the naming module."""
    if env.torch is None or env.torch_minor is None:
        raise AttnkitError(f"{env.executable}: torch is not installed; install your cell's torch first")
    if not env.torch_cuda:
        raise AttnkitError(f"{env.executable}: torch {env.torch} is a CPU build; attnkit's wheels need CUDA torch")
    local = naming.wheel_local_version(env.torch_cuda, env.torch_minor, bool(env.cxx11_abi))
    cp = "cp" + env.python.replace(".", "")
    minor = int(env.python.split(".")[1])
    plat = f"linux_{env.machine}"
    tags = {f"{cp}-{cp}-{plat}"} | {f"py3{m}-none-{plat}" for m in range(minor + 1)}
    return local, tags


def choose(cands: list[Candidate], env: PyEnv, project: str) -> Candidate:
    local, tags = wanted(env)
    fits = [c for c in cands if naming.parse_local_version(c.local) == naming.parse_local_version(local)
            and c.tags & tags]
    if fits:
        return max(fits, key=lambda c: c.version)
    if not cands:
        raise AttnkitError(f"no {project} wheels in the index")
    want = f"+{local} for Python {env.python} on {env.machine}"

    mine = naming.parse_local_version(local)
    assert mine is not None

    def diff(c: Candidate) -> list[str]:
        theirs = naming.parse_local_version(c.local)
        if theirs is None:
            return [f"not an attnkit build (local version {c.local or 'none'})"]
        d = [f"{what} {t} vs {m}" for what, t, m in zip(("CUDA", "torch", "C++11 ABI"), theirs, mine, strict=True)
             if t != m]
        if not c.tags & tags:
            d.append(f"tags {'/'.join(sorted(c.tags))}")
        return d

    ranked = sorted(cands, key=lambda c: (len(diff(c)), c.filename))[:3]
    near = "; ".join(f"{c.filename} ({', '.join(diff(c))})" for c in ranked)
    raise AttnkitError(f"no {project} wheel fits this environment ({want}); nearest: {near}")


def _sha256_of(url: str) -> str | None:
    """Hash a local (file://) wheel ourselves, so a tampered file gets our one-line error."""
    if not url.startswith("file:"):
        return None
    path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install(c: Candidate, project: str, python: str = sys.executable) -> None:
    if not c.sha256:
        raise AttnkitError(f"{c.filename}: the index gives no sha256; refusing an unverifiable install")
    local = _sha256_of(c.url)
    if local is not None and local != c.sha256:
        raise AttnkitError(f"{c.filename}: hash mismatch: the index says sha256 {c.sha256}, the file is {local}")
    with tempfile.TemporaryDirectory(prefix="attnkit-install-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{canonicalize_name(project)} @ {c.url} --hash=sha256:{c.sha256}\n")
        r = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", str(req)],
                           capture_output=True, text=True, check=False)
    if r.returncode != 0:
        text = r.stderr + r.stdout
        if "DO NOT MATCH THE HASHES" in text:
            raise AttnkitError(f"{c.filename}: hash mismatch: downloaded file does not have the index's sha256 "
                               f"{c.sha256}")
        raise AttnkitError(f"pip install {c.filename} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
