"""attnkit as users get it: its own wheel installed (not editable) in a fresh venv, run from a folder with no
checkout; a wheel site served over HTTP with test wheels for four environments (two torch x two CUDA
majors), from which pip and uv each install the right wheel without touching torch, resolving through the
PEP 658 metadata files (the server log shows which files they fetched); `attnkit install` into a pip venv
and a uv venv; Python 3.10."""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from wheelkit import fake_torch, make_wheel, verified

from attnkit.matrix import naming
from attnkit.wheels import index, retag
from attnkit.wheels.resolve import find_uv

ROOT = Path(__file__).resolve().parents[1]
# (torch minor, torch distribution version, CUDA) of the four environments. PyTorch's own indexes label the
# version (2.11.0+cu128); PyPI's torch 2.11.0 is the CUDA 13.0 build, with torch.__version__ 2.11.0+cu130.
ENVS = [("2.11", "2.11.0+cu128", "12.8"), ("2.12", "2.12.1+cu126", "12.6"),
        ("2.11", "2.11.0", "13.0"), ("2.12", "2.12.1+cu130", "13.0")]
PY = f"{sys.version_info[0]}.{sys.version_info[1]}"


def run(*cmd: str | Path, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def clean_env() -> dict[str, str]:
    """No checkout on the path, no matrix override: what a user's shell has."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNKIT_MATRIX", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def find_python(version: str) -> str:
    """An interpreter of that version: on PATH, or pyenv's (its shims answer only for the global version)."""
    for cand in [shutil.which(f"python{version}"),
                 *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))]:
        if cand and subprocess.run([cand, "--version"], capture_output=True, check=False).returncode == 0:
            return cand
    pytest.fail(f"no Python {version} on this machine (PATH or ~/.pyenv/versions): the 3.10 test needs one")


@pytest.fixture(scope="module")
def attnkit_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT)
    (whl,) = out.glob("attnkit-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    assert {"attnkit/data/matrix.yaml", "attnkit/data/recipes/flash-attn.toml",
            "attnkit/data/recipes/xformers.toml"} <= names
    return whl


def venv_with(path: Path, python: str, *install: str | Path) -> Path:
    run(python, "-m", "venv", path)
    py = path / "bin" / "python"
    if install:
        run(py, "-m", "pip", "install", "-q", *install, env=clean_env())
    return py


@pytest.fixture(scope="module")
def attnkit_bin(attnkit_wheel, tmp_path_factory) -> Path:
    py = venv_with(tmp_path_factory.mktemp("user") / "venv", sys.executable, attnkit_wheel)
    return py.parent / "attnkit"


@pytest.fixture()
def nowhere(tmp_path) -> Path:
    """A working directory with no checkout in or above it."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    return d


def attnkit(attnkit_bin: Path, cwd: Path, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(attnkit_bin, *args, check=check, cwd=cwd, env=clean_env())


def test_installed_wheel_works_without_a_checkout(attnkit_bin, nowhere):
    where = run(attnkit_bin.parent / "python", "-c", "import attnkit; print(attnkit.__file__)", cwd=nowhere).stdout
    assert "site-packages" in where and str(ROOT) not in where
    from attnkit import __version__

    assert attnkit(attnkit_bin, nowhere, "--version").stdout.strip() == f"attnkit {__version__}"
    cells = attnkit(attnkit_bin, nowhere, "matrix", "--format", "json").stdout
    assert '"torch2.11-cu130-py314"' in cells and '"torch2.14-cu130-py315"' in cells
    assert attnkit(attnkit_bin, nowhere, "index", "key", "--torch", "2.11", "--cuda", "13.0").stdout.strip() == \
        "cu13torch2.11cxx11abiTRUE"
    env = attnkit(attnkit_bin, nowhere, "wheels", "env", "--package", "xformers", "--cell", "torch2.11-cu130-py312")
    assert "TORCH_CUDA_ARCH_LIST='7.5;8.0;8.6;9.0;10.0;11.0;12.0'" in env.stdout
    # exit codes: 2 for a usage error, 1 for a failure, one line each
    r = attnkit(attnkit_bin, nowhere, "matrix", "--torch", "two", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--torch: 'two' is not MAJOR.MINOR" in r.stderr
    r = attnkit(attnkit_bin, nowhere, "frobnicate", check=False)
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr
    r = attnkit(attnkit_bin, nowhere, "matrix", "--file", "nope.yaml", check=False)
    assert r.returncode == 1 and r.stderr.strip() == "attnkit: error: nope.yaml: no such file; pass --file PATH to a matrix.yaml"
    r = attnkit(attnkit_bin, nowhere, "index", "key", "--torch", "2.11", check=False)
    assert r.returncode == 2 and "give both --torch X.Y and --cuda X.Y" in r.stderr
    r = attnkit(attnkit_bin, nowhere, "images", "build", "--cell", "torch2.13-cpu-py311", check=False)
    assert r.returncode == 1 and "run from an attnkit checkout" in r.stderr and "Traceback" not in r.stderr


def test_python_310_runs_the_wheel_commands(attnkit_wheel, tmp_path, nowhere):
    """tomllib is 3.11+: on 3.10 attnkit needs tomli, declared for it."""
    py = venv_with(tmp_path / "v310", find_python("3.10"), attnkit_wheel)
    assert run(py, "-c", "import sys; print(sys.version_info[:2])").stdout.strip() == "(3, 10)"
    r = run(py.parent / "attnkit", "wheels", "env", "--package", "flash-attn", "--cell", "torch2.11-cu130-py310",
            "--format", "json", cwd=nowhere, env=clean_env())
    assert '"FLASH_ATTN_CUDA_ARCHS": "80;90;100;120"' in r.stdout
    assert run(py, "-c", "import tomli; print('ok')").stdout.strip() == "ok"


# --- a wheel site over HTTP ------------------------------------------------------------------------------

class Server:
    def __init__(self, root: Path, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
                                      "--directory", str(root)], stdout=self._fh, stderr=subprocess.STDOUT)
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def mark(self) -> int:
        self._fh.flush()
        return len(self.log.read_text().splitlines())

    def gets(self, since: int) -> list[str]:
        time.sleep(0.2)  # the server writes its line after the response
        lines = self.log.read_text().splitlines()[since:]
        return [m.group(1) for ln in lines if (m := re.search(r'"GET (\S+) HTTP', ln))]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._fh.close()


def _cell_wheel(base: Path, house: Path, project: str, version: str, torch: str, cuda: str) -> Path:
    """A test wheel taken through the pipeline's own naming and retag for one cell, with its report."""
    fname = naming.wheel_filename(project, version, cuda=cuda, torch=torch, cxx11_abi=True, python=PY,
                                  wheel_tag="py39-none")
    out = retag.retag(base, house, fname, torch)
    return verified(out, naming.cell_id(torch, cuda, PY))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    raw = tmp_path_factory.mktemp("raw")
    house, house2 = tmp_path_factory.mktemp("house"), tmp_path_factory.mktemp("house2")
    tag = "py39-none-linux_x86_64"
    good = make_wheel(raw, "attnkit_demo", "1.0", tag, requires=("torch", "attnkit-demo-dep>=1"))
    # a newer release whose dependency no index has: resolvers must read its metadata and fall back to 1.0
    (raw / "newer").mkdir()
    bait = make_wheel(raw / "newer", "attnkit_demo", "1.1", tag, requires=("torch", "attnkit-demo-dep>=99"))
    greedy = make_wheel(raw, "attnkit_greedy", "1.0", tag, requires=("torch", "attnkit-newtorch"))
    for torch_minor, _, cuda in ENVS:
        _cell_wheel(good, house, "attnkit-demo", "1.0", torch_minor, cuda)
        _cell_wheel(bait, house, "attnkit-demo", "1.1", torch_minor, cuda)
        _cell_wheel(good, house2, "attnkit-demo", "1.0", torch_minor, cuda)
        _cell_wheel(greedy, house2, "attnkit-greedy", "1.0", torch_minor, cuda)
    index.build_index(house, root / "site")
    index.build_index(house2, root / "site2")
    # "PyPI": the dependency, a decoy attnkit-demo without a local label, a newer torch, and a package
    # that would pull that torch in
    up = root / "upstream"
    files = {"attnkit-demo-dep": make_wheel(raw, "attnkit_demo_dep", "1.0", "py3-none-any", requires=()),
             "attnkit-demo": make_wheel(raw / "newer", "attnkit_demo", "1.0", "py3-none-any", requires=()),
             "torch": fake_torch(raw, "2.11.9", "13.0"),  # within the wheels' pin (<2.12), newer than installed
             "attnkit-newtorch": make_wheel(raw, "attnkit_newtorch", "1.0", "py3-none-any", requires=("torch>=2.11.9",))}
    for project, whl in files.items():
        (up / "simple" / project).mkdir(parents=True)
        shutil.copyfile(whl, up / "simple" / project / whl.name)
        (up / "simple" / project / "index.html").write_text(f'<a href="{whl.name}">{whl.name}</a>\n')
    server = Server(root, tmp_path_factory.mktemp("log") / "http.log")
    yield server, raw
    server.stop()



def _record(**row: object) -> None:
    """With ATTNKIT_DIST_REPORT=path, keep what each resolver fetched (docs/results/<date>-distribution.json)."""
    path = os.environ.get("ATTNKIT_DIST_REPORT")
    if path:
        import json

        rows = json.loads(Path(path).read_text()) if Path(path).is_file() else []
        Path(path).write_text(json.dumps([*rows, row], indent=1))


def installed(py: Path, dist: str) -> str | None:
    r = run(py, "-c", f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\nexcept Exception: print('-')")
    out = r.stdout.strip()
    return None if out == "-" else out


def torch_env(path: Path, torch_version: str, cuda: str, uv: bool) -> Path:
    """A venv (pip's, or uv's, which has no pip) with a `torch` of that version and CUDA installed."""
    (path.parent / "torch-wheel").mkdir()
    label = naming.accelerator_label(cuda)
    wheel = fake_torch(path.parent / "torch-wheel", torch_version, cuda, module_version=f"{torch_version.split('+')[0]}+{label}")
    if uv:
        run(find_uv(), "venv", "-q", "--python", sys.executable, path)
        py = path / "bin" / "python"
        run(find_uv(), "pip", "install", "-q", "--python", py, "--no-index", wheel)
        assert not (path / "bin" / "pip").exists()
        return py
    return venv_with(path, sys.executable, "--no-index", wheel)


@pytest.mark.parametrize("tool", ["pip", "uv"])
@pytest.mark.parametrize(("torch_minor", "torch_version", "cuda"), ENVS, ids=[f"{t[1]}" for t in ENVS])
def test_pip_and_uv_install_the_right_wheel_from_the_keys_index(served, attnkit_bin, tmp_path, nowhere, tool,
                                                                 torch_minor, torch_version, cuda):
    server, _ = served
    py = torch_env(tmp_path / "env", torch_version, cuda, uv=tool == "uv")
    key = attnkit(attnkit_bin, nowhere, "index", "key", "--python", py).stdout.strip()
    assert key == naming.index_key(cuda, torch_minor, True)
    simple = f"{server.url}/site/{key}/simple/"
    upstream = f"{server.url}/upstream/simple/"
    mark = server.mark()
    if tool == "pip":
        run(py, "-m", "pip", "install", "--no-cache-dir", "attnkit-demo", "--index-url", simple,
            "--extra-index-url", upstream, env=clean_env())
    else:
        run(find_uv(), "pip", "install", "--no-cache", "--python", py, "attnkit-demo", "--index", simple,
            "--default-index", upstream, env=clean_env())
    assert installed(py, "attnkit-demo") == f"1.0+{key}"
    assert installed(py, "attnkit-demo-dep") == "1.0"
    assert installed(py, "torch") == torch_version  # untouched
    got = server.gets(mark)
    wheels = sorted(p.rsplit("/", 1)[-1] for p in got if p.endswith(".whl"))
    ours = naming.wheel_filename("attnkit-demo", "1.0", cuda=cuda, torch=torch_minor, cxx11_abi=True, python=PY,
                                 wheel_tag="py39-none")
    newer = ours.replace("-1.0+", "-1.1+")
    version = run(*([py, "-m", "pip"] if tool == "pip" else [find_uv()]), "--version").stdout.split()[1]
    _record(tool=tool, tool_version=version, torch=torch_version, key=key, installed=installed(py, "attnkit-demo"),
            requests=got)
    # of our index, one wheel is downloaded: the one installed. 1.1 is judged by its metadata file alone (and
    # dropped: its dependency exists nowhere). The dependency comes from "PyPI"; no torch wheel is fetched.
    assert [w for w in wheels if w.startswith("attnkit_demo-")] == [ours.replace("+", "%2B")], got
    assert f"/site/files/{newer.replace('+', '%2B')}.metadata" in got, got
    assert set(wheels) == {ours.replace("+", "%2B"), "attnkit_demo_dep-1.0-py3-none-any.whl"}, got


@pytest.mark.parametrize("tool", ["pip", "uv"])
def test_attnkit_install_brings_dependencies_and_holds_torch(served, attnkit_bin, tmp_path, nowhere, tool):
    server, _ = served
    torch_minor, torch_version, cuda = ENVS[2]
    py = torch_env(tmp_path / "env", torch_version, cuda, uv=tool == "uv")
    env = clean_env()
    upstream = f"{server.url}/upstream/simple/"
    env.update({"PIP_INDEX_URL": upstream, "UV_DEFAULT_INDEX": upstream})  # the dependencies' index ("PyPI")
    if tool == "uv":
        env["PATH"] = f"{Path(find_uv()).parent}{os.pathsep}{env['PATH']}"
    r = run(attnkit_bin, "install", "attnkit-demo", "--index", f"{server.url}/site2", "--python", py, cwd=nowhere,
            env=env)
    key = naming.index_key(cuda, torch_minor, True)
    assert f"with {tool}; torch stays 2.11.0+cu130" in r.stdout  # torch.__version__ (distribution 2.11.0)
    assert installed(py, "attnkit-demo") == f"1.0+{key}"
    assert installed(py, "attnkit-demo-dep") == "1.0"  # a dependency that had to be installed
    # a dependency that wants another torch (2.11.9, which "PyPI" has and the wheel's own pin allows): pip and
    # uv would upgrade torch for it; attnkit's constraint refuses, torch is kept, one line
    r = run(attnkit_bin, "install", "attnkit-greedy", "--index", f"{server.url}/site2", "--python", py, cwd=nowhere,
            env=env, check=False)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"attnkit: error: {tool} install attnkit_greedy-1.0+{key}") and "torch" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert installed(py, "torch") == torch_version and installed(py, "attnkit-newtorch") is None
    # wheel-url: the URL on stdout, the pip and uv commands for the key's index on stderr
    r = run(attnkit_bin, "wheel-url", "attnkit-demo", "--index", f"{server.url}/site2", "--python", py, cwd=nowhere,
            env=env)
    assert r.stdout.strip().startswith(f"{server.url}/site2/files/attnkit_demo-1.0%2B{key}-py39-none-linux_x86_64.whl#sha256=")
    assert f"uv pip install attnkit-demo==1.0 --index {server.url}/site2/{key}/simple/" in r.stderr
    assert f"pip install attnkit-demo==1.0 --index-url {server.url}/site2/{key}/simple/ --extra-index-url" in r.stderr


def test_attnkit_install_without_pip_or_uv_says_what_to_do(served, attnkit_bin, tmp_path, nowhere):
    server, _ = served
    py = torch_env(tmp_path / "env", ENVS[2][1], ENVS[2][2], uv=True)
    env = clean_env()
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "uv").exists())
    r = run(attnkit_bin, "install", "attnkit-demo", "--index", f"{server.url}/site2", "--python", py, cwd=nowhere,
            env=env, check=False)
    assert r.returncode == 1
    assert "that environment has no pip and uv is not installed" in r.stderr, r.stderr
