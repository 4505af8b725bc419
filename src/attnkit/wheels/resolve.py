"""Find the wheel that fits an environment (`attnkit wheel-url`) and install it (`attnkit install`).

What fits: the environment's index key (naming.index_key of its torch: CUDA major, torch major.minor,
C++11 ABI, the same function that named the wheel when it was built) picks the index; among its wheels,
the tags the target interpreter itself supports (packaging.tags, evaluated in that interpreter) and the
highest version decide. Installing goes through pip, or uv where the environment has no pip, with the
wheel's dependencies and torch held at the installed version.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from attnkit._progress import download
from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.wheels import protect
from attnkit.wheels.pyenv import PyEnv, describe


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


def _as_url(index: str) -> str:
    return index if "://" in index else Path(index).resolve().as_uri()


def index_url(index: str, env: PyEnv) -> str:
    """The simple index to read: `index` itself when it is one (its path ends in /simple), else the site
    root's index for the environment's key (SITE/<key>/simple/)."""
    url = _as_url(index).rstrip("/")
    if url.rsplit("/", 1)[-1] == "simple":
        return url + "/"
    return naming.simple_index_url(url, env.index_key())


def listing(simple: str, project: str, source: str = "--index") -> list[Candidate]:
    """Wheels of `project` in a PEP 503 index (URL, file:// URL or local directory). `source` names where the
    index came from, for the error when it cannot be read."""
    page = f"{_as_url(simple).rstrip('/')}/{canonicalize_name(project)}/"
    target = page + "index.html" if page.startswith("file:") else page
    try:
        with urllib.request.urlopen(target, timeout=60) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException) as exc:  # ValueError: a malformed URL (bad port, IPv6)
        raise AttnkitError(f"{source}: cannot read {target} ({exc})") from None
    parser = _Links()
    parser.feed(text)
    out = []
    page_scheme = urllib.parse.urlsplit(page).scheme
    for href in parser.hrefs:
        scheme = urllib.parse.urlsplit(href).scheme.lower()
        if scheme not in ("", "http", "https") or (scheme and page_scheme not in ("http", "https")):
            continue  # only http(s) links, or links relative to the index (a file:// link in a page is not)
        url, _, frag = urllib.parse.urljoin(page, href).partition("#")
        fname = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        if not fname.endswith(".whl"):
            continue
        sha = frag.split("=", 1)[1].lower() if frag.startswith("sha256=") else None
        try:
            version = parse_wheel_filename(fname)[1]
        except (InvalidWheelFilename, InvalidVersion):  # a link that is no wheel of any project: not a candidate
            continue
        out.append(Candidate(fname, url, sha, version))
    return out


def stable_listing(index: str, project: str) -> list[Candidate]:
    """The site's stable-ABI wheels of `project` (SITE/stable/simple/), [] when the site has none or `index`
    is one simple index rather than a site."""
    url = _as_url(index).rstrip("/")
    if url.rsplit("/", 1)[-1] == "simple":
        return []
    try:
        return listing(f"{url}/stable/simple/", project)
    except AttnkitError:
        return []


def choose(cands: list[Candidate], env: PyEnv, project: str, stable: list[Candidate] | None = None) -> Candidate:
    """The highest version among the wheels of the environment's key whose tags it supports; ties go to the
    tag the interpreter prefers (a cp312 wheel over a py39-none one, manylinux_2_28 over linux). Where no
    wheel was built for the key itself, a stable-ABI wheel that serves it (its CUDA major, a torch at or above
    its floor): the most archs, then the highest version. `stable`: the site's stable-ABI wheels, which say
    why none serves an environment whose torch is below their floor."""
    key = env.index_key()
    mine = naming.parse_local_version(key)
    rank = {t: i for i, t in enumerate(env.tags)}

    def best_tag(c: Candidate) -> int | None:
        found = [rank[t] for t in c.tags if t in rank]
        return min(found) if found else None

    fits = [c for c in cands if naming.parse_local_version(c.local) == mine and best_tag(c) is not None]
    if fits:
        return max(fits, key=lambda c: (c.version, -(best_tag(c) or 0)))
    pool = {c.filename: c for c in [*(stable or []), *cands] if naming.parse_stable_local(c.local) is not None}
    by_torch = [c for c in pool.values() if naming.stable_serves(c.local, key)]
    serving = [c for c in by_torch if best_tag(c) is not None]
    if serving:
        return max(serving, key=lambda c: (len((naming.parse_stable_local(c.local) or ("", "", ()))[2]), c.version,
                                           -(best_tag(c) or 0)))
    assert mine is not None
    below = [c for c in pool.values() if (naming.parse_stable_local(c.local) or ("",))[0] == mine[0]
             and not naming.stable_serves(c.local, key)]
    if below and not by_torch and not [c for c in cands if naming.parse_local_version(c.local) is not None]:
        c = min(below, key=lambda c: c.filename)
        floor = (naming.parse_stable_local(c.local) or ("", "?"))[1]
        raise AttnkitError(f"{project}: its stable-ABI wheel {c.filename} needs torch >= {floor}; this environment "
                           f"has torch {env.torch} (+{key}), below that floor, and no {project} wheel is built for "
                           f"torch {mine[1]}: upgrade torch to {floor} or newer")
    if not cands:
        raise AttnkitError(f"no {project} wheels in the index")

    def diff(c: Candidate) -> list[str]:
        theirs = naming.parse_local_version(c.local)
        st = naming.parse_stable_local(c.local)
        if st is not None:
            d = [f"stable ABI for {st[0]} torch >= {st[1]}"]
            if best_tag(c) is None:
                d.append(f"tags {'/'.join(sorted(c.tags))} (this Python {env.python} takes e.g. {env.tags[0]})")
            return d
        if theirs is None:
            return [f"not an attnkit build for one environment (local version {c.local or 'none'})"]
        assert mine is not None
        d = [f"{what} {t} vs {m}" for what, t, m in zip(("CUDA", "torch", "C++11 ABI"), theirs, mine, strict=True)
             if t != m]
        if best_tag(c) is None:
            d.append(f"tags {'/'.join(sorted(c.tags))} (this Python {env.python} takes e.g. {env.tags[0]})")
        return d

    ranked = sorted(cands, key=lambda c: (len(diff(c)), c.filename))[:3]
    near = "; ".join(f"{c.filename} ({', '.join(diff(c))})" for c in ranked)
    raise AttnkitError(f"no {project} wheel fits this environment (+{key}, Python {env.python} on {env.machine}); "
                       f"nearest: {near}")


def _fetch_checked(c: Candidate, folder: Path) -> Path:
    """The wheel as a local file whose sha256 is the index's: a tampered file never reaches the installer."""
    if not c.sha256:
        raise AttnkitError(f"{c.filename}: the index gives no sha256; refusing an unverifiable install")
    if c.url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(c.url).path))
    else:
        path = download(c.url, folder / c.filename, f"downloading {c.filename}")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != c.sha256:
        raise AttnkitError(f"{c.filename}: hash mismatch: the index says sha256 {c.sha256}, the file is {got}")
    return path


def find_uv() -> str | None:
    """uv on PATH, else the binary of the `uv` Python package (pip install uv)."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return str(find_uv_bin())
    except FileNotFoundError:
        return None


def installer_command(env: PyEnv, wheel: Path, constraints: Path, deps: bool) -> list[str]:
    """pip where the environment has it, else `uv pip install --python` (uv venvs have no pip)."""
    args = [str(wheel), "--constraint", str(constraints)] + ([] if deps else ["--no-deps"])
    if env.has_pip:
        return [env.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    uv = find_uv()
    if uv is None:
        raise AttnkitError(f"--python {env.executable}: that environment has no pip and uv is not installed; "
                           f"`pip install uv` (or `{env.executable} -m ensurepip`)")
    return [uv, "pip", "install", "--python", env.executable, *args]


def _failure(output: str) -> str:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("ERROR:", "error:", "×")) or "No solution found" in ln:
            detail = [x for x in lines[lines.index(ln) + 1:] if x.startswith(("╰─▶", "Because", "The conflict"))]
            return (ln + (" " + detail[0] if detail else ""))[:400]
    return (lines[-1] if lines else "no output")[:400]


def install(c: Candidate, project: str, env: PyEnv, deps: bool = True) -> str:
    """Install `c` into `env` with its dependencies, torch pinned to the installed build; returns the tool
    used. Before: the wheel must not write into another distribution's packages (protect.py). After: torch's
    version and every file its RECORD lists must be as they were."""
    held = env.torch_dist or env.torch
    assert held is not None
    with tempfile.TemporaryDirectory(prefix="attnkit-install-") as tmp:
        wheel = _fetch_checked(c, Path(tmp))
        torch_before = protect.check_no_foreign_writes(wheel, project, env.executable)
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={held}\n")  # the installed distribution: never change the user's torch
        cmd = installer_command(env, wheel, constraints, deps)
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    tool = "pip" if env.has_pip else "uv"
    torch_files, half = protect.torch_after(env.executable, project)
    if r.returncode != 0:
        why = _failure(r.stderr + "\n" + r.stdout)
        if re.search(r"\btorch\b", why):
            why += f" (attnkit holds torch at the installed {held})"
        if half:  # pip's own rollback did not run: say exactly what is left
            why += f"; it left {', '.join(half)} without a RECORD (pip cannot uninstall it): remove that folder"
        raise AttnkitError(f"{tool} install {c.filename} failed: {why}")
    changed = protect.changed_files(torch_before, torch_files)
    if changed:
        raise AttnkitError(f"{tool} changed {len(changed)} of torch's files while installing {c.filename} "
                           f"({', '.join(changed[:3])}); reinstall torch {held}")
    after = describe(env.executable)
    if (after.torch_dist, after.torch) != (env.torch_dist, env.torch):
        raise AttnkitError(f"{tool} changed torch from {env.torch} (distribution {env.torch_dist}) to {after.torch} "
                           f"(distribution {after.torch_dist}) while installing {c.filename}")
    return tool
