"""`attnkit matrix outdated`: what PyPI has that is newer than the matrix.

The matrix pins torch (the newest patch of each minor it lists), flash-attn and xformers (built here),
flash-attn-4 (used as published) and nvidia-cudnn-frontend (the images' pin, attnkit.images.wheelhouse). Each is
compared with the newest release in the index's JSON API (`<index>/<name>/json`, PyPI's
https://pypi.org/pypi/<name>/json): a release counts when it has at least one file that is not yanked, and a
pre-release counts only where the matrix itself pins a pre-release of that package (flash-attn-4 4.0.0b36).

Pure functions over the answers (`releases`, `findings`) and one reader (`fetch_json`), so the comparison is
tested without a network.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from attnkit.errors import AttnkitError, UsageError
from attnkit.matrix.schema import Matrix

DEFAULT_INDEX = "https://pypi.org/pypi"
TRACKED = ("torch", "flash-attn", "flash-attn-4", "xformers", "nvidia-cudnn-frontend")


@dataclass(frozen=True)
class Release:
    version: Version
    uploaded: str  # the date of its first file, YYYY-MM-DD ("" when the index gives none)


@dataclass(frozen=True)
class Finding:
    name: str
    newer: str
    uploaded: str
    matrix_has: str  # what the matrix has instead, in words

    def line(self) -> str:
        when = f", uploaded {self.uploaded}" if self.uploaded else ""
        return f"{self.name} {self.newer} is on the index{when}; {self.matrix_has}"


def pins(m: Matrix) -> dict[str, list[str]]:
    """The versions the matrix has, per tracked package (torch: one per minor)."""
    from attnkit.images.wheelhouse import CUDNN_FRONTEND_VERSION

    out: dict[str, list[str]] = {"torch": [rel.version for rel in m.torch.values()]}
    # a package pinned by git commit (FlashAttention-3) is not on PyPI: its releases are git tags, not checked here
    out.update({name: [pkg.version] for name, pkg in m.packages.items() if pkg.sdist is not None})
    out.update({name: [pp.version] for name, pp in m.pypi_packages.items()})
    out["nvidia-cudnn-frontend"] = [CUDNN_FRONTEND_VERSION]
    return out


def releases(doc: Mapping[str, Any], url: str) -> list[Release]:
    """The releases of one JSON API answer that have a file not yanked, oldest first. `url` names it in errors."""
    table = doc.get("releases") if isinstance(doc, Mapping) else None
    if not isinstance(table, Mapping):
        raise AttnkitError(f"{url}: not a JSON API answer (no 'releases' mapping)")
    out: list[Release] = []
    for text, files in table.items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue  # legacy version strings; nothing the matrix could pin
        live = [f for f in files or [] if isinstance(f, Mapping) and not f.get("yanked")]
        if live:
            uploaded = min(str(f.get("upload_time") or "") for f in live)[:10]
            out.append(Release(version, uploaded))
    return sorted(out, key=lambda r: r.version)


def _eligible(available: list[Release], have: list[Version]) -> list[Release]:
    pre_ok = any(v.is_prerelease or v.is_devrelease for v in have)
    return [r for r in available if pre_ok or not (r.version.is_prerelease or r.version.is_devrelease)]


def torch_findings(have: list[str], available: list[Release]) -> list[Finding]:
    """A newer patch of a minor the matrix lists, and every minor newer than its newest (at its newest patch)."""
    versions = [Version(v) for v in have]
    by_minor: dict[tuple[int, int], Version] = {(v.major, v.minor): v for v in versions}
    newest_minor = max(by_minor)
    latest: dict[tuple[int, int], Release] = {}
    for r in _eligible(available, versions):
        latest[(r.version.major, r.version.minor)] = r  # sorted: the last one is the newest
    out: list[Finding] = []
    for minor, r in sorted(latest.items()):
        ours = by_minor.get(minor)
        if ours is not None and r.version > ours:
            out.append(Finding("torch", str(r.version), r.uploaded, f"the matrix has torch {minor[0]}.{minor[1]} "
                                                                     f"at {ours}"))
        elif ours is None and minor > newest_minor:
            out.append(Finding("torch", str(r.version), r.uploaded,
                               f"the matrix has no torch {minor[0]}.{minor[1]} (its newest: "
                               f"{newest_minor[0]}.{newest_minor[1]} at {by_minor[newest_minor]})"))
    return out


def package_findings(name: str, have: list[str], available: list[Release]) -> list[Finding]:
    """The newest release, when it is newer than every version the matrix pins."""
    versions = [Version(v) for v in have]
    eligible = _eligible(available, versions)
    if not eligible or eligible[-1].version <= max(versions):
        return []
    r = eligible[-1]
    return [Finding(name, str(r.version), r.uploaded, f"the matrix pins {', '.join(have)}")]


def findings(m: Matrix, answers: Mapping[str, list[Release]]) -> list[Finding]:
    """Everything newer than the matrix, in TRACKED order; `answers` maps each name to its index releases."""
    have = pins(m)
    out: list[Finding] = []
    for name in TRACKED:
        if name == "torch":
            out.extend(torch_findings(have[name], answers[name]))
        elif name in have:
            out.extend(package_findings(name, have[name], answers[name]))
    return out


def check_index_url(index_url: str) -> str:
    parts = urllib.parse.urlsplit(index_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--index-url: {index_url!r} is not an http(s) URL such as {DEFAULT_INDEX}")
    return index_url.rstrip("/")


def project_url(index_url: str, name: str) -> str:
    return f"{index_url.rstrip('/')}/{name}/json"


def fetch_json(url: str, timeout: float = 30.0) -> Any:
    """The parsed answer at `url`; every failure is one line that names the URL."""
    try:
        req = urllib.request.Request(url, headers={"Accept": "application/json", "User-Agent": "attnkit"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:
        raise AttnkitError(f"cannot read {url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise AttnkitError(f"cannot read {url}: {exc.reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed URL
        raise AttnkitError(f"cannot read {url}: {exc or type(exc).__name__}") from None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise AttnkitError(f"{url}: not JSON ({exc})") from None


def outdated(m: Matrix, index_url: str = DEFAULT_INDEX,
             fetch: Callable[[str], Any] = fetch_json) -> list[Finding]:
    """Read each tracked package's JSON from the index and compare (the command's whole job)."""
    base = check_index_url(index_url)
    answers: dict[str, list[Release]] = {}
    for name in TRACKED:
        url = project_url(base, name)
        answers[name] = releases(fetch(url), url)
    return findings(m, answers)
