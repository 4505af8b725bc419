"""Malformed matrix files: each gives ONE line naming the file (and field/line) and what is allowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli import main

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "matrix").glob("*.yaml"))


def _expect(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), path
    return first.removeprefix("# expect: ")


def test_there_are_at_least_25_fixtures():
    assert len(FIXTURES) >= 25


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_malformed_matrix_gives_one_line(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["matrix", "--file", str(path), "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 1  # a failure (the file), not a usage error
    assert out == ""  # nothing half-written to stdout
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"attnkit: error: {path}"), lines[0]
    assert _expect(path) in lines[0]
    assert "Traceback" not in err


def test_no_traceback_from_the_console_script(tmp_path: Path) -> None:
    bad = tmp_path / "m.yaml"
    bad.write_text("schema_version: 1\ntorch: [\n")
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "matrix", "--file", str(bad)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert f"{bad}:" in r.stderr and "YAML syntax error" in r.stderr


def test_missing_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["matrix", "--file", str(tmp_path / "nope.yaml")]) == 1
    err = capsys.readouterr().err
    assert "no such file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "expect", "rc"),
    [
        (["--torch", "2.8", "--cuda", "13.0"], "torch 2.8 does not ship CUDA 13.0", 1),
        (["--torch", "2.9", "--python", "3.9"], "torch 2.9 supports Python 3.10-3.14, not 3.9", 1),
        (["--torch", "2.7"], "torch 2.7 is not in the matrix", 2),
        (["--cuda", "11.8"], "CUDA 11.8 is not in the matrix", 2),
        (["--torch", "two"], "--torch: 'two' is not MAJOR.MINOR", 2),
        (["--cuda", "13"], "--cuda: '13' is not MAJOR.MINOR", 2),
        (["--package", "flash-attn-9"], "unknown package 'flash-attn-9'", 2),
        (["--package", "xformers", "--torch", "2.9"], "no cell is built for xformers 0.0.35 (it needs torch >= 2.10", 1),
        (["--package", "flash-attn", "--cuda", "cpu"], "flash-attn needs CUDA", 1),
        (["--torch", "2.12", "--cuda", "13.2"], "compatible, but no such cell is built", 1),
        (["--format", "yaml"], "invalid choice: 'yaml'", 2),
        (["--no-such-option"], "unrecognized arguments: --no-such-option", 2),
    ],
)
def test_forbidden_or_bad_filters(argv: list[str], expect: str, rc: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 for a usage error (the command line: its shape, or a value the matrix does not know), 1 for a
    failure (a combination of known values that the facts refuse)."""
    assert main(["matrix", *argv]) == rc
    err = capsys.readouterr().err
    assert expect in err, err
    assert len(err.strip().splitlines()) == 1
