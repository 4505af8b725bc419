"""`nox -s release-rehearsal`: the release path of one CPU cell end to end on this machine, with the commands
of release.yml and images.yml (steps.py), against real parts started here and stopped at the end:

  registry   Debian's docker-registry (distribution 2.8) on 127.0.0.1:<free port>, temp config and storage
  site       `attnkit index build --base-url` of a verified test wheel, served by http.server on 127.0.0.1,
             the wheels and their PEP 658 metadata under releases/download/<tag>/ (what `gh release upload` does)
  images     the CPU cell's runtime image built with podman, pushed and smoke-gated by `attnkit images promote`;
             a copy made to fail its smoke is promoted the same way and must get no moving tag
  user side  `podman pull` of the moving tag, `attnkit doctor` and the smoke inside (buildah, chroot isolation);
             `pip install`, `uv pip install` (the documented commands) and `attnkit install` from the site, each
             into a fresh venv, then the installed op runs

It writes a JSON report (tags, digests, what the failing image got, the HTTP server's log lines per installer,
doctor and smoke counts, wall time) and a log. Usage: `python -m attnkit.release.rehearsal --report R --log L`.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from attnkit._io import write_atomic
from attnkit.errors import AttnkitError, UsageError
from attnkit.images.context import source_tree
from attnkit.images.promote import MANIFEST_TYPES, SMOKE, pinned, registry_digest, run_inside, tags_for
from attnkit.images.report import smoke_counts
from attnkit.matrix import load_matrix, naming
from attnkit.matrix.expand import Cell, find_cell
from attnkit.release.docs import pull_block, replace_block
from attnkit.release.steps import render
from attnkit.wheels.index import install_commands
from attnkit.wheels.pyenv import torch_requirement

CELL = "torch2.13-cpu-py311"  # the CPU cell: its image is what `nox -s e2e` builds
WHEEL_CELL = "torch2.14-cu130-py311"  # the test wheel's cell: this venv's CUDA torch (nox -s release-rehearsal)
PROJECT, VERSION = "attnkit-tinyext", "0.1.0"
# Why the rehearsal does not also run a CUDA cell (measured on the 2-core machine; see docs/usage.md):
CUDA_WHY = ("a CUDA cell's image is 6.0 GB (torch2.11-cu130-py313-runtime, built here on the nvidia/cuda stand-in: "
            "first build 464 s, smoke stage 79 s, docs/results/2026-11-30-image-torch2.11-cu130-py313-runtime.json); "
            "pushing and pulling it through the registry (gzip on 2 cores) and smoking it twice would take the "
            "rehearsal from ~5 to ~20 minutes; and no CUDA cell the local base can build (Debian's Python 3.11 or "
            "3.13) owns a moving tag (latest is py3.12, torch<X.Y>-cu<NNN> the newest Python), so its gate would "
            "move nothing; its cell wheels (flash-attn, xformers) are hours of nvcc each. The CUDA path that the "
            "rehearsal does run: the test wheel, a real nvcc build against the CUDA 13.0 torch 2.14.1, through the "
            "site to pip, uv and attnkit install")
UV_CACHE_NOTE = ("uv installs torch 2.14.1 (+cu130, with its CUDA wheels) into its fresh venv from PyPI itself: uv reads no "
                 ".pth file, so it cannot share this venv's torch as pip's and attnkit's venvs do; uv's cache on this "
                 "machine already held those wheels (19 s for a first, cold install, measured once)")
# the failing image: the cell's image with torch's main library removed (a broken layer), so `nox -s smoke` exits 1
FAILING = ("FROM {base}\nUSER 0\nRUN rm -f /opt/venv/lib/python{py}/site-packages/torch/lib/libtorch_cpu.so\n"
           "USER 10001\n")

def torch_index(cell: Cell, log: Log) -> str:
    """PyTorch's index for the cell, as images.yml uses it, where its host resolves; else PyPI (pip then finds
    the cell's torch in its configured find-links folder, as on the 2-core machine)."""
    index = torch_requirement(cell)[1]
    host = urllib.parse.urlsplit(index).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
        return index
    except OSError:
        log.say(f"{host} does not resolve here: the wheelhouse's torch comes from PyPI / pip's find-links instead")
        return "https://pypi.org/simple"


def installed_lines(output: str) -> list[str]:
    """What an installer said it resolved and installed: pip's 'Successfully installed ...', uv's 'Resolved N
    packages' and its '+ name==version' lines for our project, attnkit's 'installed ...'."""
    keep = []
    for ln in (x.strip() for x in output.splitlines()):
        if ln.startswith(("Successfully installed", "Resolved ", "Installed ", "installed ")) or (
                ln.startswith("+ ") and PROJECT in ln):
            keep.append(ln[:300])
    return keep


def served(lines: list[str]) -> dict[str, Any]:
    """The HTTP server's log of one installer: every request that was served (200), and the projects it asked our
    index for that are not there (404: pip and uv look for every dependency in each index they were given)."""
    import re

    ok = [ln for ln in lines if '" 200 ' in ln]
    missing = sorted({m.group(1) for ln in lines if '" 404 ' in ln for m in [re.search(r"/simple/([^/ ]+)/", ln)] if m})
    return {"server_log": ok, "not_on_our_index": missing}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Log:
    """The rehearsal's log: each command, its exit status and the tail of its output."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {text}"
        self.lines.append(line)
        print(line, file=sys.stderr, flush=True)

    def output(self, text: str, keep: int = 25) -> None:
        rows = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
        if len(rows) > keep:
            rows = [f"... ({len(rows) - keep} lines left out)", *rows[-keep:]]
        self.lines += ["    " + r[:400] for r in rows]


def run(log: Log, cmd: list[str], *, expect: int = 0, env: dict[str, str] | None = None,
        keep: int = 25) -> subprocess.CompletedProcess[str]:
    """Run and log: the command, the tail of its stderr (progress, errors), a few last lines of its stdout."""
    log.say("$ " + shlex.join(cmd))
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    log.output(r.stderr, keep)
    log.output(r.stdout, max(3, keep // 3))
    log.say(f"  exit {r.returncode} in {time.monotonic() - t0:.1f} s")
    if r.returncode != expect:
        last = [ln for ln in (r.stderr + r.stdout).strip().splitlines() if ln.strip()]
        raise AttnkitError(f"rehearsal: `{shlex.join(cmd)[:160]}` exited {r.returncode}, expected {expect}: "
                           f"{(last or ['no output'])[-1][:300]}")
    return r


def attnkit_argv(argv: list[str]) -> list[str]:
    """A step's `attnkit ...` as run here: this interpreter's attnkit (the session's venv)."""
    assert argv[0] == "attnkit"
    return [sys.executable, "-m", "attnkit.cli", *argv[1:]]


@contextmanager
def registry(work: Path, log: Log) -> Iterator[str]:
    """Debian's docker-registry on 127.0.0.1:<free port>, its storage under `work`; yields 127.0.0.1:PORT."""
    exe = shutil.which("docker-registry")
    if exe is None:
        raise AttnkitError("rehearsal: docker-registry is not installed (apt-get install docker-registry)")
    port = free_port()
    cfg = work / "registry.yml"
    cfg.write_text(f"version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {work / 'storage'}\n"
                   f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n")
    out = (work / "registry.log").open("w")
    proc = subprocess.Popen([exe, "serve", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
    log.say(f"registry: {exe} serve {cfg} (pid {proc.pid}) on 127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AttnkitError(f"rehearsal: docker-registry did not start: {(work / 'registry.log').read_text()[-300:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        log.say(f"registry stopped (exit {proc.returncode})")


class _Handler(http.server.SimpleHTTPRequestHandler):
    access: ClassVar[list[str]]  # set per server by http_site
    lock: ClassVar[threading.Lock]

    def log_error(self, format: str, *args: Any) -> None:
        pass  # a 404's "code 404, message File not found": its request line says it already

    def log_message(self, format: str, *args: Any) -> None:
        with self.lock:
            self.access.append(f"{self.address_string()} [{self.log_date_time_string()}] {format % args}")


@contextmanager
def http_site(root: Path, log: Log) -> Iterator[tuple[str, list[str]]]:
    """http.server serving `root` on 127.0.0.1:<free port>, in a thread; yields (URL, its access log)."""
    access: list[str] = []
    handler = type("Handler", (_Handler,), {"access": access, "lock": threading.Lock()})

    def factory(*a: Any, **kw: Any) -> http.server.SimpleHTTPRequestHandler:
        return handler(*a, directory=str(root), **kw)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), factory)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    log.say(f"site: http.server for {root} on {url}")
    try:
        yield url, access
    finally:
        server.shutdown()
        server.server_close()
        log.say(f"site stopped ({len(access)} requests)")


def registry_state(reg: str, repos: list[str]) -> dict[str, dict[str, str]]:
    """For each repository: tag -> the digest the registry serves for it (HEAD of its manifest)."""
    state: dict[str, dict[str, str]] = {}
    for repo in repos:
        try:
            with urllib.request.urlopen(f"http://{reg}/v2/{repo}/tags/list", timeout=10) as r:
                tags = json.load(r).get("tags") or []
        except OSError:
            tags = []
        state[repo] = {}
        for tag in sorted(tags):
            req = urllib.request.Request(f"http://{reg}/v2/{repo}/manifests/{tag}", method="HEAD",
                                         headers={"Accept": MANIFEST_TYPES})
            with urllib.request.urlopen(req, timeout=10) as r:
                state[repo][tag] = r.headers.get("Docker-Content-Digest", "?")
    return state


def fresh_venv(path: Path, torch_site: str | None) -> str:
    """A new venv; with `torch_site`, it sees that folder's torch (the cell's CUDA torch, 5.5 GB) through a
    .pth file instead of a second copy, as the wheel pipeline's e2e test does."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = str(path / "bin" / "python")
    if torch_site:
        site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "cell-torch.pth").write_text(torch_site + "\n")
    return py


def user_image(log: Log, pull_tag: str, promoted: str) -> dict[str, Any]:
    """A user's `podman pull` of the tag into an empty store, then `attnkit doctor` and the smoke inside it."""
    t0 = time.monotonic()
    run(log, ["podman", "pull", "--tls-verify=false", pull_tag], keep=4)
    pull_seconds = round(time.monotonic() - t0, 1)
    digest = registry_digest("podman", pull_tag, False)
    repo_digests = json.loads(subprocess.run(["podman", "image", "inspect", "--format", "{{json .RepoDigests}}",
                                              pull_tag], capture_output=True, text=True, check=True).stdout)
    size = subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", pull_tag], capture_output=True,
                          text=True, check=True).stdout.strip()
    log.say("$ python -m attnkit.cli doctor --json (in the pulled image: buildah run --isolation chroot)")
    doc = run_inside("podman", pull_tag, "python -m attnkit.cli doctor --json", gpus=False)
    log.say(f"  exit {doc.returncode}")
    backends = json.loads(doc.stdout).get("backends", {}) if doc.returncode == 0 else {}
    log.say(f"$ {SMOKE} (in the pulled image)")
    sm = run_inside("podman", pull_tag, SMOKE, gpus=False)
    log.output(sm.stdout + sm.stderr, 8)
    log.say(f"  exit {sm.returncode}")
    if doc.returncode != 0 or sm.returncode != 0:
        raise AttnkitError(f"rehearsal: in the pulled {pull_tag}: doctor exit {doc.returncode}, smoke exit {sm.returncode}")
    return {"pulled": pull_tag, "into": "an empty image store", "pull_seconds": pull_seconds,
            "image_bytes": int(size) if size.isdigit() else None, "digest": digest,
            "digest_is_the_promoted_one": digest == promoted, "pulled_image_has_it": pinned(pull_tag, digest) in repo_digests,
            "doctor": {"exit": doc.returncode, "backends": len(backends),
                       "available": sorted(b for b, v in backends.items() if v.get("available"))},
            "smoke": {"exit": sm.returncode, "counts": smoke_counts(sm.stdout + sm.stderr)}}


def rehearse(work: Path, log: Log, rep: dict[str, Any]) -> None:
    """Run the rehearsal, filling `rep` as it goes (so a failure still leaves what was found)."""
    tree = source_tree()
    m = load_matrix(None)
    cell = find_cell(m, CELL)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    rep.update({"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, {mem:.0f} GiB, no GPU",
                           "python": sys.version.split()[0], "cell": CELL, "wheel_cell": WHEEL_CELL,
                           "cuda_cell": {"done": False, "why": CUDA_WHY}, "phases_seconds": {}})
    phases = rep["phases_seconds"]

    def phase(name: str, since: float) -> float:
        now = time.monotonic()
        phases[name] = round(now - since, 1)
        return now

    www = work / "www"
    (www / "site").mkdir(parents=True)
    (work / "registry").mkdir()
    with registry(work / "registry", log) as reg, http_site(www, log) as (url, access):
        t = time.monotonic()
        # 1. the wheel: a real nvcc build through the pipeline, verified, named by naming.py
        house = work / "artifacts" / "wheelhouse"
        r = run(log, attnkit_argv(render("wheel", recipe=str(tree / "tests/fixtures/tinyext/recipe.toml"),
                                         wheel_cell=WHEEL_CELL, python=sys.executable, wheelhouse=str(house),
                                         build_dir=str(work / "build"))), keep=8)
        built = json.loads(r.stdout)
        rep["wheel"] = {"file": built["wheel"], "sha256": built["sha256"], "verified": built["verify"]["ok"],
                        "archs": built["verify"]["checks"]["archs_found"]}
        t = phase("wheel build (nvcc, 2 archs)", t)
        # 2. the verified site, linking the release assets as release.yml does
        tag = "v0.0.0-rehearsal"
        assets = www / "releases" / "download" / tag
        run(log, attnkit_argv(render("site", wheelhouse=str(house), site=str(www / "site"),
                                     base_url=f"{url}/releases/download/{tag}/", site_url=f"{url}/site")))
        assets.mkdir(parents=True)
        for f in [*house.glob("*.whl"), *(www / "site" / "files").glob("*.whl.metadata")]:
            shutil.copyfile(f, assets / f.name)  # what `gh release upload` puts there
        wcell = find_cell(m, WHEEL_CELL)
        assert wcell.cuda is not None
        key = naming.index_key(wcell.cuda, wcell.torch, wcell.cxx11_abi)
        simple = naming.simple_index_url(f"{url}/site", key)
        rep["site"] = {"url": f"{url}/site", "key": key, "simple": simple, "release_assets": sorted(
            p.name for p in assets.iterdir())}
        t = phase("site", t)
        # 3. the image, pushed and gated
        ctx = work / "context"
        ctx.mkdir()
        for name in ("noxfile.py", "pyproject.toml"):
            shutil.copyfile(tree / name, ctx / name)
        here = naming.host_platform()
        run(log, attnkit_argv(render("image-wheelhouse", cell=CELL, context=str(ctx), platform=here,
                                     torch_index=torch_index(cell, log))))
        t = phase("image wheelhouse", t)
        run(log, attnkit_argv(render("image-build", cell=CELL, context=str(ctx))), keep=6)
        local = cell.image_tags["runtime"][0]
        t = phase("image build (podman)", t)
        registry_repo = f"{reg}/attnkit"
        run(log, attnkit_argv(render("promote", cell=CELL, registry=registry_repo, local_image=local,
                                     report=str(work / "promote.json"))), keep=12)
        good = json.loads((work / "promote.json").read_text())
        t = phase("push + smoke + promote", t)
        # 4. the same gate on an image made to fail its smoke
        bad_ctx = work / "failing"
        bad_ctx.mkdir()
        (bad_ctx / "Containerfile").write_text(FAILING.format(base=local, py=cell.python))
        failing_local = f"localhost/attnkit-smokefail:{CELL}-runtime"
        run(log, ["podman", "build", "--isolation", "chroot", "-t", failing_local, "-f", str(bad_ctx / "Containerfile"),
                  str(bad_ctx)], keep=4)
        failing_registry = f"{reg}/smokefail"
        r = run(log, attnkit_argv(render("promote-failing", cell=CELL, failing_registry=failing_registry,
                                         failing_image=failing_local, failing_report=str(work / "failing.json"))),
                expect=1, keep=12)
        bad = json.loads((work / "failing.json").read_text())
        t = phase("failing image: build + push + smoke (refused)", t)
        good_repo, bad_repo = (naming.image_repo(r_, m.publish.image).split("/", 1)[1]
                               for r_ in (registry_repo, failing_registry))
        state = registry_state(reg, [good_repo, bad_repo])
        rep["registry"] = {"address": reg, "software": _registry_version(), "tags": state}
        rep["pushed"] = {"immutable": good["immutable"], "digests": good["digests"], "moved": good["moved"],
                         "smoke_counts": good["smoke_counts"], "smoke_seconds": good["smoke_seconds"],
                         "docker_pull_pinned": {v: f"docker pull {pinned(tag_, good['digests'][v])}"
                                                for v, tag_ in good["immutable"].items()}}
        rep["failing_image"] = {"change": FAILING.format(base=local, py=cell.python).splitlines()[2],
                                "smoke_tail": bad["smoke_tail"], "immutable": bad["immutable"],
                                "digests": bad["digests"], "smoke_exit": bad["smoke_exit"],
                                "smoke_counts": bad["smoke_counts"], "why_not": bad["why_not"],
                                "moving_tags_it_would_get": bad["moving_tags"], "moved": bad["moved"],
                                "promote_error": r.stderr.strip().splitlines()[-1]}
        # 5. the user's side: the moving tag from the registry
        immutable, moving = tags_for(m, cell, "runtime", registry_repo, None)
        pull_tag = moving[0] if moving else immutable
        with own_image_store(work / "user", log, copy_base=False):
            rep["user_image"] = user_image(log, pull_tag, good["digests"]["runtime"])
        t = phase("user: pull + doctor + smoke", t)
        # 6. the user's side: pip, uv and attnkit install from the served key index, each into a fresh venv
        torch_site = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        cmds = install_commands(simple, PROJECT, VERSION)
        check = ("import torch, attnkit_tinyext, importlib.metadata as md; x = torch.arange(4.0); "
                 "print(md.version('attnkit-tinyext'), torch.ops.attnkit_tinyext.scale(x, 3.0).tolist(), torch.__version__)")
        installs: dict[str, Any] = {}
        for tool in ("pip", "uv", "attnkit install"):
            venv = work / f"user-{tool.replace(' ', '-')}"
            # uv reads no .pth file: its venv gets torch from PyPI itself, as a uv user's would
            py = fresh_venv(venv, None if tool == "uv" else torch_site)
            start = len(access)
            if tool == "pip":
                argv = [py, "-m", *shlex.split(cmds["pip"])]
            elif tool == "uv":
                uv = Path(sys.executable).with_name("uv")
                argv = [str(uv) if uv.is_file() else "uv", *shlex.split(cmds["uv"])[1:], "--python", py]
            else:
                argv = attnkit_argv(["attnkit", "install", PROJECT, "--index", f"{url}/site", "--python", py])
            ir = run(log, argv, keep=6)
            out = run(log, [py, "-c", check]).stdout.strip()
            installs[tool] = {"command": shlex.join(argv), "installed": installed_lines(ir.stdout + ir.stderr),
                              "runs": out, **served(access[start:])}
        rep["installs"] = installs
        phase("user: pip, uv, attnkit install", t)
        rep["uv_cache"] = UV_CACHE_NOTE
    rep["registry"]["requests"] = registry_requests((work / "registry" / "registry.log").read_text(errors="replace"))
    digest = good["digests"]["runtime"]
    imm_name, moving_names = immutable.rsplit(":", 1)[1], [t.rsplit(":", 1)[1] for t in moving]
    wheel_url = built["wheel"].replace("+", "%2B")
    rep["checks"] = checks = {
        "the good image's moving tags name its smoke-tested digest":
            bool(moving_names) and all(state[good_repo].get(t) == digest for t in [imm_name, *moving_names]),
        "the failing image's repository holds its immutable tag only": list(state[bad_repo]) == [imm_name],
        "the failing image's smoke failed and promote moved nothing": bad["smoke_exit"] != 0 and not bad["moved"],
        "the user pulled the promoted digest": rep["user_image"]["digest_is_the_promoted_one"]
            and rep["user_image"]["pulled_image_has_it"],
        "the smoke passed in the pulled image": (rep["user_image"]["smoke"]["counts"] or {}).get("passed", 0) > 0
            and not (rep["user_image"]["smoke"]["counts"] or {}).get("failed", 0),
        **{f"{tool}: the wheel came from the site's release assets and its op ran":
           any(wheel_url in ln and '" 200 ' in ln for ln in i["server_log"]) and "[0.0, 3.0, 6.0, 9.0]" in i["runs"]
           for tool, i in installs.items()},
    }
    failed = [c for c, ok in checks.items() if not ok]
    if failed:
        raise AttnkitError(f"rehearsal: {len(failed)} check(s) failed: {'; '.join(failed)}")


def registry_requests(log_text: str) -> dict[str, int]:
    """The registry's access log, counted by method and kind of path ('GET manifests', 'PUT blobs' ...)."""
    import re

    counts: dict[str, int] = {}
    for m in re.finditer(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) /v2/\S*?/(manifests|blobs|tags)/', log_text):
        key = f"{m.group(1)} {m.group(2)}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _registry_version() -> str:
    r = subprocess.run(["docker-registry", "--version"], capture_output=True, text=True, check=False)
    return r.stdout.strip()


BASE = "localhost/debian-base:bookworm"  # the debootstrap base images/base.py makes (the CPU cell's Debian 12)


@contextmanager
def own_image_store(work: Path, log: Log, copy_base: bool = True) -> Iterator[None]:
    """A podman/buildah image store of the rehearsal's own (CONTAINERS_STORAGE_CONF, under `work`), removed at
    the end: its builds and pulls never mix with the machine's store (where `nox -s e2e` may be building the
    same tags), and it starts without their layer cache. The debootstrap base is copied in when the machine's
    store has it (else images/base.py makes it there). Without `copy_base`: an empty store, a user's machine."""
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{work / "containers" / "storage"}"\n'
                    f'runroot = "{work / "containers" / "run"}"\n')
    env = dict(os.environ, CONTAINERS_STORAGE_CONF=str(conf))
    if copy_base and subprocess.run(["podman", "image", "exists", BASE], check=False).returncode == 0:
        save = subprocess.Popen(["podman", "save", BASE], stdout=subprocess.PIPE)
        subprocess.run(["podman", "load"], stdin=save.stdout, capture_output=True, check=True, env=env)
        save.wait()
        log.say(f"image store: {work / 'containers'} (its own), {BASE} copied in")
    elif not copy_base:
        log.say(f"image store: {work / 'containers'} (empty: the user's machine)")
    old = os.environ.get("CONTAINERS_STORAGE_CONF")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(conf)
    try:
        yield
    finally:
        subprocess.run(["buildah", "rm", "--all"], capture_output=True, check=False)
        subprocess.run(["podman", "rmi", "--all", "--force"], capture_output=True, check=False)
        left = subprocess.run(["podman", "images", "-a", "-q"], capture_output=True, text=True, check=False).stdout.split()
        if old is None:
            os.environ.pop("CONTAINERS_STORAGE_CONF", None)
        else:
            os.environ["CONTAINERS_STORAGE_CONF"] = old
        shutil.rmtree(work / "containers", ignore_errors=True)
        log.say(f"image store removed ({len(left)} image(s) left in it before removal)")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except UsageError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 2


def _check_args(a: argparse.Namespace) -> None:
    """Before five minutes of work: the outputs can be written, the doc has its markers."""
    for opt, path in (("--report", a.report), ("--log", a.log)):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{opt} {path}: its folder does not exist")
    if a.docs:
        try:
            replace_block(Path(a.docs).read_text(encoding="utf-8"), "")
        except OSError as exc:
            raise UsageError(f"--docs {a.docs}: cannot be read ({exc.strerror or type(exc).__name__})") from None
        except ValueError as exc:
            raise UsageError(f"--docs {a.docs}: {exc}") from None


def _main(argv: list[str] | None) -> int:
    from attnkit.cli import _Parser

    p = _Parser(prog="python -m attnkit.release.rehearsal", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", required=True, help="write the JSON report here")
    p.add_argument("--log", help="write the log here (default: the report's path with .log)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (registry storage, site, venvs)")
    p.add_argument("--docs", help="regenerate this doc's pinned `docker pull` block from the report (docs/usage.md)")
    a = p.parse_args(argv)
    _check_args(a)
    log_path = Path(a.log) if a.log else Path(a.report).with_suffix(".log")
    log = Log()
    work = Path(tempfile.mkdtemp(prefix="attnkit-rehearsal-"))
    t0 = time.monotonic()
    rep: dict[str, Any] = {}
    rc = 1
    try:
        with own_image_store(work, log):
            rehearse(work, log, rep)
        rc = 0
    except AttnkitError as exc:
        log.say(f"FAILED: {exc}")
        rep["error"] = str(exc)
    except KeyboardInterrupt:
        log.say("interrupted")
        rep["error"] = "interrupted"
        raise
    finally:
        rep["wall_seconds"] = round(time.monotonic() - t0, 1)
        rep["load_average_1_5_15_min_at_end"] = [round(x, 2) for x in os.getloadavg()]  # CPU shared with others?
        log.say(f"rehearsal {'passed' if rc == 0 else 'FAILED'} in {rep['wall_seconds']:.0f} s; report {a.report}")
        write_atomic(a.report, json.dumps(rep, indent=1, default=str) + "\n")
        write_atomic(log_path, "\n".join(log.lines) + "\n")
        if a.docs and rc == 0:
            doc = Path(a.docs)
            write_atomic(doc, replace_block(doc.read_text(encoding="utf-8"), pull_block(rep, a.report)))
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
