"""What a new user meets (issue 27, items 14 and 17): wheel-url for a package attnkit does not build is refused
before any network; an unreachable default site is named as the default site, not as --index; help texts."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from attnkit.cli import build_parser, main
from attnkit.wheels import pyenv


def test_unknown_package_is_refused_before_the_network(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("went to the network"))
    assert main(["wheel-url", "nosuchpkg"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'nosuchpkg' is not built by attnkit" in err and "--index" in err


def test_an_unreachable_default_site_is_named_as_such(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    env = pyenv.PyEnv("/py", "3.12", "x86_64", "2.11.0+cu130", "13.0", True, ("cp312-cp312-linux_x86_64",))
    monkeypatch.setattr(pyenv, "describe", lambda python=None: env)

    def refuse(*a: object, **k: object) -> None:
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    assert main(["wheel-url", "flash-attn"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the default wheel site (matrix.yaml publish.wheel_site" in err
    assert not err.startswith("attnkit: error: --index")


def test_every_argument_of_the_user_facing_commands_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("wheel-url", "install", "bench", "smoke", "oracle", "doctor"):
        for action in sub.choices[name]._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.dest}"


@pytest.mark.parametrize("argv", [
    ["smoke", "--case", "mha", "--backend", "sdpa_math", "--report", "/proc/attnkit-no/r.json"],
    ["smoke", "--case", "mha", "--backend", "sdpa_math", "--report", "/tmp/" + "x" * 300 + ".json"],
])
def test_an_unwritable_report_is_one_line_naming_the_path(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and "cannot be written" in err
    assert argv[-1][:40] in err


def test_a_closed_pipe_is_not_an_error():
    """`attnkit matrix | head -c 1`: the reader goes away; the command exits 0 and prints nothing on stderr (a
    broken pipe is an OSError, and it must not come out as main()'s one-line machine error)."""
    import subprocess
    import sys

    r = subprocess.run(f"{sys.executable} -m attnkit.cli matrix --format json | head -c 1 > /dev/null; "
                       "echo ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "0" and "error" not in r.stderr, (r.stdout, r.stderr)
