"""`attnkit matrix outdated` against a local stand-in of PyPI's JSON API (http.server on 127.0.0.1, serving
tests/data/pypi/<name>.json, trimmed from https://pypi.org/pypi/<name>/json on 2026-12-01): no network."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.matrix import outdated
from attnkit.matrix.outdated import Release

ROOT = Path(__file__).resolve().parents[1]
PYPI = Path(__file__).parent / "data" / "pypi"


class _Api(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture
def index(tmp_path: Path) -> Any:
    """A folder served as <url>/<name>/json, filled with the recorded PyPI answers; yields (folder, url)."""
    root = tmp_path / "api"
    for name in outdated.TRACKED:
        (root / name).mkdir(parents=True)
        shutil.copy(PYPI / f"{name}.json", root / name / "json")
    handler = lambda *a, **k: _Api(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def matrix_without_2_15(tmp_path: Path) -> Path:
    """The real matrix as it was before torch 2.15 was added: the same file less its 2.15 release."""
    text = (ROOT / "matrix.yaml").read_text()
    start = text.index('  "2.15":\n')
    end = text.index("\n\n", start)
    path = tmp_path / "matrix-2.14.yaml"
    path.write_text(text[:start] + text[end + 1:])
    assert "2.15" not in yaml.safe_load(path.read_text())["torch"]
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    rc = main(["matrix", "outdated", *args])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def test_names_torch_2_15_for_a_matrix_that_stops_at_2_14(index: Any, tmp_path: Path, capsys: Any) -> None:
    _, url = index
    rc, out, err = run(capsys, "--file", str(matrix_without_2_15(tmp_path)), "--index-url", url)
    assert (rc, err) == (1, [])
    assert out == ["torch 2.15.0 is on the index, uploaded 2026-10-28; the matrix has no torch 2.15 "
                   "(its newest: 2.14 at 2.14.1)"]


def test_the_real_matrix_does_not_name_torch_2_15(index: Any, capsys: Any) -> None:
    _, url = index
    rc, out, err = run(capsys, "--file", str(ROOT / "matrix.yaml"), "--index-url", url + "/")
    assert (rc, err) == (0, [])
    assert not any("torch 2.15" in line for line in out)
    assert out == [f"the matrix is up to date with {url} (torch, flash-attn, flash-attn-4, xformers, "
                   "nvidia-cudnn-frontend)"]


def test_one_line_per_finding(index: Any, tmp_path: Path, capsys: Any) -> None:
    """A newer patch of a listed minor, a newer flash-attn and a newer flash-attn-4 pre-release each give a line."""
    root, url = index
    torch = json.loads((root / "torch" / "json").read_text())
    torch["releases"]["2.14.2"] = [{"filename": "torch-2.14.2-cp312-cp312-manylinux_2_28_x86_64.whl",
                                    "upload_time": "2026-11-20T10:00:00", "yanked": False}]
    (root / "torch" / "json").write_text(json.dumps(torch))
    fa = json.loads((root / "flash-attn" / "json").read_text())
    fa["releases"]["2.8.4"] = [{"filename": "flash_attn-2.8.4.tar.gz", "upload_time": "2026-11-25T00:00:00"}]
    (root / "flash-attn" / "json").write_text(json.dumps(fa))
    fa4 = json.loads((root / "flash-attn-4" / "json").read_text())
    fa4["releases"]["4.0.0b37"] = [{"filename": "flash_attn_4-4.0.0b37-py3-none-any.whl", "upload_time": ""}]
    (root / "flash-attn-4" / "json").write_text(json.dumps(fa4))
    rc, out, _ = run(capsys, "--file", str(matrix_without_2_15(tmp_path)), "--index-url", url)
    assert rc == 1
    assert out == [
        "torch 2.14.2 is on the index, uploaded 2026-11-20; the matrix has torch 2.14 at 2.14.1",
        "torch 2.15.0 is on the index, uploaded 2026-10-28; the matrix has no torch 2.15 (its newest: 2.14 at 2.14.1)",
        "flash-attn 2.8.4 is on the index, uploaded 2026-11-25; the matrix pins 2.8.3.post2",
        "flash-attn-4 4.0.0b37 is on the index; the matrix pins 4.0.0b36",
    ]


def rel(version: str, yanked: bool = False) -> dict[str, Any]:
    return {"filename": f"x-{version}.tar.gz", "upload_time": "2026-11-01T00:00:00", "yanked": yanked}


def test_pre_releases_and_yanked_files_are_not_newer() -> None:
    doc = {"releases": {"2.14.1": [rel("2.14.1")], "2.14.2": [rel("2.14.2", yanked=True)], "2.15.0rc1": [rel("x")],
                        "2.16.0.dev20261201": [rel("x")], "2.17.0": [], "not-a-version": [rel("x")]}}
    available = outdated.releases(doc, "u")
    assert [str(r.version) for r in available] == ["2.14.1", "2.15.0rc1", "2.16.0.dev20261201"]
    assert outdated.torch_findings(["2.13.0", "2.14.1"], available) == []
    # a matrix that pins a pre-release compares with pre-releases too
    assert [f.newer for f in outdated.package_findings("p", ["2.15.0b1"], available)] == ["2.16.0.dev20261201"]
    assert [f.newer for f in outdated.package_findings("p", ["2.14.0"], available)] == ["2.14.1"]
    assert outdated.package_findings("p", ["2.14.1"], available) == []


def test_older_minors_and_gaps_are_not_findings() -> None:
    available = [Release(outdated.Version(v), "") for v in ("1.13.1", "2.7.1", "2.8.0", "2.9.1", "2.10.0")]
    assert outdated.torch_findings(["2.8.0", "2.10.0"], available) == []  # 2.9 is not listed: not a finding


def test_an_unreadable_index_is_one_line_naming_the_url(index: Any, tmp_path: Path, capsys: Any) -> None:
    root, url = index
    shutil.rmtree(root / "xformers")
    rc, out, err = run(capsys, "--file", str(ROOT / "matrix.yaml"), "--index-url", url)
    assert (rc, out) == (1, [])
    assert err == [f"attnkit: error: cannot read {url}/xformers/json: HTTP 404 File not found"]

    (root / "xformers").mkdir()
    (root / "xformers" / "json").write_text("<html>maintenance</html>")
    rc, out, err = run(capsys, "--file", str(ROOT / "matrix.yaml"), "--index-url", url)
    assert rc == 1 and len(err) == 1 and err[0].startswith(f"attnkit: error: {url}/xformers/json: not JSON (")

    (root / "xformers" / "json").write_text('{"info": {}}')
    rc, out, err = run(capsys, "--file", str(ROOT / "matrix.yaml"), "--index-url", url)
    assert rc == 1 and err == [f"attnkit: error: {url}/xformers/json: not a JSON API answer (no 'releases' mapping)"]


def test_a_refused_connection_names_the_url(capsys: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err = run(capsys, "--file", str(ROOT / "matrix.yaml"), "--index-url", f"http://127.0.0.1:{port}")
    assert (rc, out) == (1, []) and len(err) == 1
    assert err[0].startswith(f"attnkit: error: cannot read http://127.0.0.1:{port}/torch/json: ")


@pytest.mark.parametrize(("args", "message"), [
    (["--index-url", "ftp://mirror/pypi"], "--index-url: 'ftp://mirror/pypi' is not an http(s) URL"),
    (["--index-url", "pypi.org/pypi"], "--index-url: 'pypi.org/pypi' is not an http(s) URL"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_usage_errors_exit_2(capsys: Any, args: list[str], message: str) -> None:
    rc, out, err = run(capsys, *args)
    assert (rc, out) == (2, []) and len(err) == 1 and message in err[0]


def test_cell_filters_do_not_apply_to_outdated(capsys: Any) -> None:
    rc = main(["matrix", "--torch", "2.15", "outdated", "--index-url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err == ["attnkit: error: matrix outdated: takes --file and --index-url only, not --torch"]


def test_matrix_without_a_subcommand_still_lists_torch_2_15_cells(capsys: Any) -> None:
    assert main(["matrix", "--torch", "2.15", "--format", "json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert sorted(c["id"] for c in cells) == [f"torch2.15-cu13{c}-py3{p}" for c in (0, 2) for p in range(11, 16)]


def test_pins_cover_every_tracked_package(matrix) -> None:
    from attnkit.images.wheelhouse import CUDNN_FRONTEND_VERSION

    have = outdated.pins(matrix)
    assert set(have) == set(outdated.TRACKED)
    assert have["nvidia-cudnn-frontend"] == [CUDNN_FRONTEND_VERSION]
    assert have["flash-attn-4"] == [matrix.pypi_packages["flash-attn-4"].version]
    assert "2.15.0" in have["torch"]
    with pytest.raises(AttnkitError, match="not a JSON API answer"):
        outdated.releases([], "u")  # type: ignore[arg-type]
