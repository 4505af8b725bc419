"""Build a cell's image with whatever builder the machine has: `docker buildx bake` where a Docker engine
runs, otherwise podman (daemonless, chroot isolation). Where no base image can be pulled, images/base.py makes
one here and it is passed as BASE_IMAGE."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnkit._progress import run_streamed
from attnkit.errors import AttnkitError
from attnkit.images.context import source_tree
from attnkit.matrix import emit, naming
from attnkit.matrix.expand import Cell
from attnkit.matrix.schema import Matrix

_STEP = re.compile(r"^(\[\d+/\d+\] )?STEP \d+/\d+|^#\d+ \[")  # podman/buildah steps; buildx's "#5 [env 2/3]"


def detect_builder() -> str:
    """'docker' when `docker buildx` reaches an engine, else 'podman', else an error saying what is missing."""
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "buildx", "inspect", "--bootstrap"], capture_output=True, check=False)
        if ok.returncode == 0:
            return "docker"
    if shutil.which("podman"):
        return "podman"
    raise AttnkitError("images: no builder: need a Docker engine with buildx, or podman "
                       "(apt-get install podman buildah)")


@dataclass
class ImageReport:
    cell: str
    variant: str
    target: str
    builder: str
    tag: str
    base_image: str
    seconds: float = 0.0
    size_bytes: int | None = None
    cache_hits: int = 0
    steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    platform: str = "linux/amd64"


def build_args(cell: Cell, variant: str, base_image: str | None, revision: str) -> dict[str, str]:
    args = emit.bake_args(cell, variant)
    if base_image:
        args["BASE_IMAGE"] = base_image
    args["REVISION"] = revision
    return args


def wheelhouse_digest(folder: Path) -> str:
    """sha256 over every file of a wheelhouse (relative names and contents), in a stable order."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def wheelhouse_labels(house: Path, cell: Cell) -> dict[str, str]:
    """The version build args (and so labels) of what the wheelhouse really holds: a package left out is
    'none', a test build carries its marked version ('0.0.35+cu13torch2.11cxx11abiTRUE.sm90')."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    path = house / "manifest.json"
    if not path.is_file():
        return {}
    held = {canonicalize_name(parse_wheel_filename(w)[0]): w.split("-")[1]  # the version as named, not lower-cased
            for w in json.loads(path.read_text()).get("cell_wheels", [])}
    return {f"{naming.dist_name(p.name).upper()}_VERSION": held.get(canonicalize_name(p.name), "none")
            for p in cell.packages_on()}


def _git_revision(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return r.stdout.strip() or "unknown"


def _fold_structs(line: str, keep: int = 60) -> str:
    """podman prints the whole step struct (`{Env:[...] ... Original:RUN ...}`) before the cause of a failed step;
    fold every brace group longer than `keep` so the cause, which comes after it, survives the line limit."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(line):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                group = line[start:i + 1]
                out.append(group if len(group) <= keep else "{...}")
        elif depth == 0:
            out.append(ch)
    if depth:
        out.append(line[start:])
    return "".join(out)


def _clip(line: str, limit: int = 300) -> str:
    """Keep the head (what failed) and the tail (why) of a long line."""
    line = _fold_structs(line.strip())
    if len(line) <= limit:
        return line
    head = limit // 3
    return line[:head] + " ... " + line[-(limit - head - 5):]


def _cli(builder: str) -> str:
    """The CLI that inspects what a builder built (docker for buildx bake, else podman)."""
    return "docker" if builder == "docker" else "podman"


def store_dir(builder: str) -> Path | None:
    """Where the builder keeps its layers (podman's graphRoot, Docker's root dir): the disk a build fills."""
    tool = _cli(builder)
    fmt = "{{.DockerRootDir}}" if tool == "docker" else "{{.Store.GraphRoot}}"
    if shutil.which(tool) is None:
        return None
    r = subprocess.run([tool, "info", "--format", fmt], capture_output=True, text=True, check=False)
    return Path(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else None


def store_space(builder: str) -> str:
    """The builder's image store and its disk's free space, for logs and the out-of-space error."""
    store = store_dir(builder)
    if store is None or not store.exists():
        return "its image store"
    return f"{store} ({shutil.disk_usage(store).free / 2**30:.1f} GiB free now)"


def _out_of_space(builder: str) -> str:
    return (f"no space left on device: {builder} writes layers to {store_space(builder)}; a cell's image needs "
            f"about 3x its environment there; free some with `{_cli(builder)} image prune` (dangling images of "
            "earlier builds)")


def _explain_failure(output: str, builder: str = "podman") -> str:
    if "no space left on device" in output.lower():
        return _out_of_space(builder)
    if "DO NOT MATCH THE HASHES" in output:
        m = re.search(r"(\S+\.whl)", output[output.find("DO NOT MATCH THE HASHES"):])
        which = m.group(1) if m else "a wheel"
        return f"the wheelhouse's {which} does not match its sha256 in requirements.txt (tampered or stale)"
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("ERROR:"):
            return _clip(ln)
    for ln in reversed(lines):
        if "error" in ln.lower():
            return _clip(ln)
    return _clip(lines[-1]) if lines else "no output"


def build_image(m: Matrix, cell: Cell, variant: str = "runtime", *, target: str | None = None,
                base_image: str | None = None, builder: str | None = None, tag: str | None = None,
                context: Path = Path(), log: Path | None = None, platform: str | None = None) -> ImageReport:
    """Build one target of the Dockerfile of attnkit's source tree, over `context` (which holds wheelhouse/ and
    the files the Dockerfile copies), for one platform (default: this machine's; another runs under
    emulation), showing the builder's steps as progress. A local build loads one platform's image; CI's bake
    pushes the multi-arch manifest."""
    from attnkit.images.wheelhouse import wheelhouse_platforms

    target = target or variant
    platform = wheelhouse_platforms(cell, (platform,) if platform else ())[0]
    tree = source_tree()
    builder = builder or detect_builder()
    needs_house = target != "os"  # the OS stage (the distro's Python, the user) reads no wheelhouse
    if needs_house and not (context / "wheelhouse" / "requirements.txt").is_file():
        raise AttnkitError(f"images: {context / 'wheelhouse'} has no requirements.txt; run "
                           f"`attnkit images wheelhouse --cell {cell.id} --out {context / 'wheelhouse'}` first")
    manifest = context / "wheelhouse" / "manifest.json"
    served = json.loads(manifest.read_text()).get("platforms", [platform]) if manifest.is_file() else [platform]
    if needs_house and platform not in served:
        raise AttnkitError(f"images: {context / 'wheelhouse'} serves {', '.join(served)}, not {platform}; run "
                           f"`attnkit images wheelhouse --cell {cell.id} --platform {platform}` (or --platform all)")
    args = build_args(cell, variant, base_image, _git_revision(tree))
    args.update(wheelhouse_labels(context / "wheelhouse", cell))
    args["WHEELHOUSE_DIGEST"] = wheelhouse_digest(context / "wheelhouse")
    tag = tag or (cell.image_tags[variant][0] if target == variant else f"localhost/attnkit:{cell.id}-{target}")
    rep = ImageReport(cell.id, variant, target, builder, tag, args["BASE_IMAGE"], platform=platform)
    t0 = time.monotonic()
    if builder == "docker":
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            bake = json.loads(emit.to_bake(m, [cell]))
            name = naming.bake_target(cell.id, variant)
            bake["target"][name]["args"] = args
            bake["target"][name]["target"] = target
            bake["target"][name]["tags"] = [tag]
            bake["target"][name]["platforms"] = [platform]  # --load takes one platform's image
            json.dump(bake, f)
        cmd = ["docker", "buildx", "bake", "-f", str(tree / "docker" / "docker-bake.hcl"), "-f", f.name,
               "--load", "--set", f"{name}.cache-to=", name]
    else:
        cmd = ["podman", "build", "--isolation", "chroot", "--network", "host", "--layers", "--platform", platform,
               "-f", str(tree / "docker" / "Dockerfile"), "--target", target, "-t", tag]
        for k, v in args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        cmd.append(str(context))
    rc, output = run_streamed(cmd, f"{builder} build {cell.id} ({target})", _STEP, cwd=context)
    rep.seconds = round(time.monotonic() - t0, 1)
    if log:
        log.write_text(" ".join(cmd) + "\n" + output)
    if rc != 0:
        raise AttnkitError(f"images: {builder} build of {cell.id} ({target}) failed: {_explain_failure(output, builder)}")
    rep.steps = len(re.findall(r"^STEP \d+/\d+", output, flags=re.M)) or output.count("#")
    rep.cache_hits = len(re.findall(r"Using cache|CACHED", output))
    rep.size_bytes = image_size(builder, tag)
    rep.history = image_history(builder, tag)
    return rep


def image_size(builder: str, ref: str) -> int | None:
    tool = _cli(builder)
    r = subprocess.run([tool, "image", "inspect", "--format", "{{.Size}}", ref], capture_output=True, text=True,
                       check=False)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None


def image_history(builder: str, ref: str) -> list[dict[str, Any]]:
    tool = _cli(builder)
    r = subprocess.run([tool, "history", "--no-trunc", "--format", "json", ref], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        return []
    try:
        rows = json.loads(r.stdout)
    except ValueError:
        rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    out = []
    for row in rows:
        size = row.get("size", row.get("Size"))
        created_by = str(row.get("createdBy", row.get("CreatedBy", "")))
        out.append({"size": size, "created_by": created_by[:160]})
    return out


def run_in_image(ref: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run a command in a built image without a runtime daemon (buildah, chroot isolation)."""
    ctr = subprocess.run(["buildah", "from", ref], capture_output=True, text=True, check=True).stdout.strip()
    try:
        return subprocess.run(["buildah", "run", "--isolation", "chroot", ctr, "--", *cmd], capture_output=True,
                              text=True, check=False)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)


def report_dict(r: ImageReport) -> dict[str, Any]:
    return asdict(r)
