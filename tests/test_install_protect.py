"""`attnkit install` never changes torch or another package's files (issue 27, item 3), and reads only http(s) or
relative links from an index (the real pip, a real venv, a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import http.server
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from wheelkit import fake_torch, make_wheel

from attnkit.errors import AttnkitError
from attnkit.wheels import protect, resolve
from attnkit.wheels.pyenv import describe

KEY = "cu13torch2.11cxx11abiTRUE"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("env")
    subprocess.run([sys.executable, "-m", "venv", root / "venv"], check=True)
    py = root / "venv" / "bin" / "python"
    whl = fake_torch(root, "2.11.0", "13.0", module_version="2.11.0+cu130")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--disable-pip-version-check", whl], check=True)
    return py


def torch_snapshot(py: Path) -> dict[str, str]:
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(site.glob("torch*/**/*")) if p.is_file() and "__pycache__" not in p.parts}


def candidate(whl: Path) -> resolve.Candidate:
    return resolve.Candidate(whl.name, whl.resolve().as_uri(), hashlib.sha256(whl.read_bytes()).hexdigest(),
                             Version(whl.name.split("-")[1]))


def test_top_levels_of_a_wheel(tmp_path: Path) -> None:
    whl = make_wheel(tmp_path, extra={"torch/__init__.py": b"", "demo_pkg-1.0.data/purelib/evil/x.py": b"",
                                      "demo_pkg-1.0.data/scripts/tool": b""})
    assert protect.wheel_top_levels(whl) == {"demo_pkg", "torch", "evil"}


def test_a_wheel_that_ships_torch_files_is_refused_before_pip_runs(env: Path, tmp_path: Path) -> None:
    before = torch_snapshot(env)
    evil = make_wheel(tmp_path, version=f"1.0+{KEY}", requires=(), extra={"torch/__init__.py": b"__version__='x'\n"})
    with pytest.raises(AttnkitError, match=r"would write into torch/ of the installed torch 2\.11\.0: refusing"):
        resolve.install(candidate(evil), "demo-pkg", describe(str(env)), deps=False)
    assert torch_snapshot(env) == before
    assert describe(str(env)).torch == "2.11.0+cu130"


def test_torch_files_changed_by_an_install_are_found_after_it(env: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The second line of defence, with the first one switched off: torch's RECORD files are compared."""
    real = protect.check_no_foreign_writes
    (tmp_path / "clean").mkdir()
    clean = make_wheel(tmp_path / "clean", requires=())
    monkeypatch.setattr(protect, "check_no_foreign_writes", lambda wheel, project, python: real(clean, project, python))
    sneaky = make_wheel(tmp_path, "sneaky_pkg", version=f"1.0+{KEY}", requires=(),
                        extra={"sneaky_pkg-1.0+" + KEY + ".data/purelib/torch/__init__.py": b"__version__='2.11.0+cu130'\n"})
    with pytest.raises(AttnkitError, match=r"changed 1 of torch's files .*torch/__init__\.py.*reinstall torch 2\.11\.0"):
        resolve.install(candidate(sneaky), "sneaky-pkg", describe(str(env)), deps=False)
    # put the module's torch back for the tests after this one (sneaky's uninstall removes the file it wrote)
    subprocess.run([env, "-m", "pip", "uninstall", "-q", "-y", "sneaky-pkg"], check=False)
    (tmp_path / "t").mkdir()
    subprocess.run([env, "-m", "pip", "install", "-q", "--no-index", "--force-reinstall", "--no-deps",
                    fake_torch(tmp_path / "t", "2.11.0", "13.0", module_version="2.11.0+cu130")], check=True)


def test_a_failed_install_names_what_it_left_without_a_record(env: Path, tmp_path: Path) -> None:
    site = Path(subprocess.run([env, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    left = site / "broken_pkg-0.9.dist-info"
    left.mkdir()
    (left / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-pkg\nVersion: 0.9\n")
    bad = make_wheel(tmp_path, "broken_pkg", version=f"1.0+{KEY}", tag="cp27-cp27m-win32", requires=())
    try:
        with pytest.raises(AttnkitError, match=r"failed: .*left .*broken_pkg-0\.9\.dist-info without a RECORD"):
            resolve.install(candidate(bad), "broken-pkg", describe(str(env)), deps=False)
    finally:
        for p in left.iterdir():
            p.unlink()
        left.rmdir()


class _Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.endswith("short.whl"):  # promises 1000 bytes, sends 10
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"0123456789")
            return
        super().do_GET()


@pytest.fixture
def served(tmp_path: Path) -> Any:
    handler = lambda *a, **k: _Index(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_index_links_must_be_http_or_relative_and_hashes_any_case(served: Any) -> None:
    root, url = served
    page = root / "simple" / "demo-pkg"
    page.mkdir(parents=True)
    sha = "AB" * 32
    page.joinpath("index.html").write_text(
        f'<a href="javascript:alert(1)//demo_pkg-9.0-py3-none-any.whl">x</a>'
        f'<a href="file:///etc/demo_pkg-8.0-py3-none-any.whl#sha256={sha}">x</a>'
        f'<a href="../../files/demo_pkg-1.0-py3-none-any.whl#sha256={sha}">ok</a>'
        f'<a href="https://example.org/demo_pkg-2.0-py3-none-any.whl#sha256={sha}">ok</a>')
    cands = resolve.listing(f"{url}/simple/", "demo-pkg")
    assert [c.filename for c in cands] == ["demo_pkg-1.0-py3-none-any.whl", "demo_pkg-2.0-py3-none-any.whl"]
    assert cands[0].url == f"{url}/files/demo_pkg-1.0-py3-none-any.whl" and cands[0].sha256 == sha.lower()


def test_a_download_cut_short_says_so(served: Any, tmp_path: Path) -> None:
    _, url = served
    c = resolve.Candidate("short.whl", f"{url}/short.whl", "0" * 64, Version("1.0"))
    with pytest.raises(AttnkitError, match="cut short") as exc:
        resolve._fetch_checked(c, tmp_path / "dl")
    assert "hash mismatch" not in str(exc.value)
    assert not list((tmp_path / "dl").glob("*"))  # no half-written file left
