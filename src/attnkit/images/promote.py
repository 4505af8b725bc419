"""The smoke gate: an image gets its moving tags (`latest`, `torch2.11-cu130`, ...) only after `nox -s smoke`
passed inside exactly the image that was pushed. One function, called by images.yml (docker, on the GPU
runner) and by the release rehearsal (podman and buildah, against a local registry), so the two cannot drift:

  1. (--push LOCAL) push the local image to the cell's immutable tag, e.g. REG/attnkit:torch2.13-cpu-py311-runtime;
     without it (CI: `docker buildx bake --push` already did) the immutable tag is taken from the registry;
  2. pull that tag and pin it by digest (REPO@sha256:...): what is smoke-tested is what the tags will name;
  3. run `nox -s smoke` inside it (`docker run`, or `buildah run` with chroot isolation where there is no
     container runtime, as on the 2-core machine); a failed smoke, or one in which no check passed, stops here
     and no moving tag is touched;
  4. point each moving tag (names from attnkit.matrix.naming) at that digest, and check the registry's digest
     for it is the tested one.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnkit.errors import AttnkitError, UsageError
from attnkit.images.report import smoke_counts
from attnkit.matrix import naming
from attnkit.matrix.expand import Cell
from attnkit.matrix.schema import Matrix

TOOLS = ("docker", "podman")
# what the smoke stage of docker/Dockerfile runs: `nox -s smoke`, then its outcome counts on one line
SMOKE = ("python -m nox -f /opt/attnkit/noxfile.py -s smoke -- /tmp/attnkit-smoke.json && python -c \"import json; "
         "d = json.load(open('/tmp/attnkit-smoke.json')); print('smoke', d['counts'])\"")


@dataclass
class Promotion:
    cell: str
    variants: list[str]
    tool: str
    immutable: dict[str, str]  # variant -> tag
    digests: dict[str, str] = field(default_factory=dict)  # variant -> sha256:...
    smoke_ref: str = ""
    smoke_exit: int | None = None
    smoke_counts: dict[str, int] | None = None
    smoke_seconds: float = 0.0
    smoke_tail: list[str] = field(default_factory=list)
    moving_tags: dict[str, list[str]] = field(default_factory=dict)  # what the cell's naming gives
    moved: dict[str, list[str]] = field(default_factory=dict)  # what was pointed at the tested digest
    promoted: bool = False
    why_not: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def retarget(tag: str, old_repo: str, new_repo: str) -> str:
    """A tag of the published repository under another one (a local registry): same name after the ':'."""
    if not tag.startswith(old_repo + ":"):
        raise AttnkitError(f"images promote: tag {tag!r} is not in {old_repo}")
    return new_repo + tag[len(old_repo):]


def tags_for(m: Matrix, cell: Cell, variant: str, registry: str | None, image: str | None) -> tuple[str, list[str]]:
    """(immutable tag, moving tags) of `cell` x `variant`, in `registry`/`image` (default: matrix.yaml publish)."""
    old = naming.image_repo(m.publish.registry, m.publish.image)
    new = naming.image_repo(registry or m.publish.registry, image or m.publish.image)
    return (retarget(cell.image_tags[variant][0], old, new),
            [retarget(t, old, new) for t in cell.moving_tags[variant]])


def pinned(tag: str, digest: str) -> str:
    """REPO@sha256:... for REPO:TAG (a `docker pull` line that names exactly one image)."""
    repo = tag.rsplit(":", 1)[0] if ":" in tag.rsplit("/", 1)[-1] else tag
    return f"{repo}@{digest}"


def _run(cmd: list[str], what: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).strip().splitlines() if ln.strip()]
        raise AttnkitError(f"images promote: {what} failed: {(lines or ['no output'])[-1][:300]}")
    return r.stdout


def _tls(tool: str, tls_verify: bool) -> list[str]:
    return [] if tool == "docker" or tls_verify else ["--tls-verify=false"]


def push(tool: str, local: str, tag: str, tls_verify: bool) -> str:
    """Push `local` as `tag`; returns the digest the push reported (checked against the registry by the caller)."""
    if tool == "docker":
        _run(["docker", "tag", local, tag], f"docker tag {local} {tag}")
        _run(["docker", "push", tag], f"docker push {tag}")
        return registry_digest(tool, tag, tls_verify)
    with tempfile.TemporaryDirectory(prefix="attnkit-push-") as tmp:
        dfile = Path(tmp) / "digest"
        _run(["podman", "push", *_tls(tool, tls_verify), "--digestfile", str(dfile), local, tag], f"podman push {tag}")
        return dfile.read_text().strip()


MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json")


def _split(tag: str) -> tuple[str, str, str]:
    """('127.0.0.1:5000', 'attnkit/attnkit', 'torch2.13-cpu') for '127.0.0.1:5000/attnkit/attnkit:torch2.13-cpu'."""
    host, _, rest = tag.partition("/")
    repo, _, ref = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "latest")
    if "@" in rest:
        repo, _, ref = rest.partition("@")
    return host, repo, ref


def _http_digest(tag: str, tls_verify: bool) -> str:
    """The digest the registry serves for `tag` (HEAD of its manifest, Docker-Content-Digest), with an anonymous
    bearer token where the registry asks for one (ghcr.io does, for public images)."""
    import re
    import urllib.error
    import urllib.request

    host, repo, ref = _split(tag)
    url = f"{'https' if tls_verify else 'http'}://{host}/v2/{repo}/manifests/{ref}"
    headers = {"Accept": MANIFEST_TYPES}
    for _ in range(2):
        req = urllib.request.Request(url, method="HEAD", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                digest = r.headers.get("Docker-Content-Digest")
                if not digest:
                    raise AttnkitError(f"images promote: {url} gave no Docker-Content-Digest")
                return str(digest)
        except urllib.error.HTTPError as exc:
            auth = exc.headers.get("WWW-Authenticate", "") if exc.code == 401 else ""
            m = dict(re.findall(r'(\w+)="([^"]*)"', auth))
            if not m.get("realm") or "Authorization" in headers:
                raise AttnkitError(f"images promote: {url}: HTTP {exc.code}") from None
            q = "&".join(f"{k}={m[k]}" for k in ("service", "scope") if k in m)
            with urllib.request.urlopen(f"{m['realm']}?{q}", timeout=30) as r:
                headers["Authorization"] = f"Bearer {json.load(r)['token']}"
        except OSError as exc:
            raise AttnkitError(f"images promote: {url}: {exc}") from None
    raise AttnkitError(f"images promote: {url}: no digest")


def registry_digest(tool: str, tag: str, tls_verify: bool) -> str:
    """The digest `tag` names in its registry now (sha256:...), asked of the registry, not of the local store
    (podman's local `.Digest` of an image it built is not the pushed manifest's)."""
    if tool == "docker":
        out = _run(["docker", "buildx", "imagetools", "inspect", tag, "--format", "{{json .Manifest}}"],
                   f"imagetools inspect {tag}")
        return str(json.loads(out)["digest"])
    return _http_digest(tag, tls_verify)


def pull(tool: str, ref: str, tls_verify: bool) -> None:
    _run([tool, "pull", *_tls(tool, tls_verify), ref], f"{tool} pull {ref}")


def run_inside(tool: str, ref: str, script: str, gpus: bool) -> subprocess.CompletedProcess[str]:
    """`sh -c script` in the image: `docker run` where Docker runs containers, else buildah (chroot isolation;
    needs no runtime daemon and no cgroups, which is what works on the 2-core machine)."""
    if tool == "docker":
        return subprocess.run(["docker", "run", "--rm", *(["--gpus", "all"] if gpus else []), ref, "sh", "-c", script],
                              capture_output=True, text=True, check=False)
    ctr = _run(["buildah", "from", "--pull-never", ref], f"buildah from {ref}").strip()
    try:
        return subprocess.run(["buildah", "run", "--isolation", "chroot", ctr, "--", "sh", "-c", script],
                              capture_output=True, text=True, check=False)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)


def point(tool: str, tested: str, tag: str, digest: str, tls_verify: bool) -> None:
    """Point `tag` at the tested image `tested` (REPO@digest) and check the registry names the same digest."""
    if tool == "docker":
        _run(["docker", "buildx", "imagetools", "create", "-t", tag, tested], f"imagetools create -t {tag}")
    else:
        _run(["podman", "tag", tested, tag], f"podman tag {tag}")
        push(tool, tag, tag, tls_verify)
    got = registry_digest(tool, tag, tls_verify)
    if got != digest:
        raise AttnkitError(f"images promote: {tag} names {got} in the registry, not the smoke-tested {digest}")


def _cause(tail: list[str]) -> str:
    """The line that says what failed ('nox > Command ... doctor failed with exit code 1'), not the runner's
    own 'Error: exit status 1'."""
    for ln in reversed(tail):
        if "failed with" in ln or ("error" in ln.lower() and "exit status" not in ln):
            return ln[:200]
    return (tail or ["no output"])[-1][:200]


def promote(m: Matrix, cell: Cell, variants: list[str], *, tool: str, registry: str | None = None,
            image: str | None = None, push_local: dict[str, str] | None = None, tls_verify: bool = True) -> Promotion:
    """The gate (see the module's docstring). The smoke runs in the runtime image; its pass promotes every
    variant in `variants` (devel is runtime + build tools)."""
    if tool not in TOOLS:
        raise UsageError(f"--tool: {tool!r} is not one of {', '.join(TOOLS)}")
    bad = [v for v in variants if v not in cell.image_tags]
    if bad or not variants:
        raise UsageError(f"--variant: {', '.join(bad) or 'none given'}: not one of {', '.join(cell.image_tags)}")
    tags = {v: tags_for(m, cell, v, registry, image) for v in variants}
    rep = Promotion(cell.id, variants, tool, {v: t[0] for v, t in tags.items()},
                    moving_tags={v: t[1] for v, t in tags.items()})
    for v in variants:
        tag = rep.immutable[v]
        pushed = push(tool, push_local[v], tag, tls_verify) if push_local and v in push_local else None
        rep.digests[v] = registry_digest(tool, tag, tls_verify)  # what the registry has now
        if pushed and rep.digests[v] != pushed:
            raise AttnkitError(f"images promote: {tag} is {rep.digests[v]} in the registry, not the pushed {pushed}")
    runtime = "runtime" if "runtime" in variants else variants[0]
    rep.smoke_ref = pinned(rep.immutable[runtime], rep.digests[runtime])
    pull(tool, rep.smoke_ref, tls_verify)  # by digest: what is tested is what the tags will name
    t0 = time.monotonic()
    r = run_inside(tool, rep.smoke_ref, SMOKE, gpus=cell.cuda is not None)
    rep.smoke_seconds = round(time.monotonic() - t0, 1)
    output = r.stdout + "\n" + r.stderr
    rep.smoke_exit, rep.smoke_counts = r.returncode, smoke_counts(output)
    rep.smoke_tail = [ln for ln in output.strip().splitlines() if ln.strip()][-10:]
    counts = rep.smoke_counts or {}
    if r.returncode != 0 or counts.get("failed", 0) or not counts.get("passed", 0):
        rep.why_not = f"smoke in {rep.smoke_ref} failed (exit {r.returncode}, counts {rep.smoke_counts}): {_cause(rep.smoke_tail)}"
        return rep
    for v in variants:
        tested = pinned(rep.immutable[v], rep.digests[v])
        for tag in rep.moving_tags[v]:
            point(tool, tested, tag, rep.digests[v], tls_verify)
            rep.moved.setdefault(v, []).append(tag)
    rep.promoted = True
    return rep
