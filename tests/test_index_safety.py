"""`attnkit index build` never costs a user data and never writes outside --out (issue 27, items 1, 2, 4, 6).
Each case runs the real CLI and compares a snapshot of the folder around it before and after."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from wheelkit import make_wheel, verified

from attnkit.cli import main
from attnkit.wheels import index
from attnkit.wheels.accept import verification_path

KEY = "cu13torch2.11cxx11abiTRUE"


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its content hash, and every folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: their own files, and a wheel folder with one verified wheel."""
    root = tmp_path / "proj"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "notes.md").write_text("mine\n")
    (root / "train.py").write_text("print('mine')\n")
    house = root / "wheelhouse"
    house.mkdir()
    verified(make_wheel(house, version=f"1.0+{KEY}"))
    return root


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("out", [".", "docs", "wheelhouse", "wheelhouse/site", "train.py"])
@pytest.mark.parametrize("base_url", [None, "https://example.org/dl/"])
def test_refused_outs_change_nothing(project: Path, out: str, base_url: str | None,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(project.parent)
    argv = ["index", "build", str(project / "wheelhouse"), "--out", str(project / out)]
    code, err = run(argv + (["--base-url", base_url] if base_url else []), capsys)
    assert code == 2, err
    assert "--out" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert snapshot(project.parent) == before  # nothing deleted, moved or added


def test_a_site_of_ours_is_replaced_and_an_empty_folder_used(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site = project / "site"
    site.mkdir()
    assert run(["index", "build", str(project / "wheelhouse"), "--out", str(site)], capsys)[0] == 0
    assert (site / index.SITE_MARKER).is_file() and (site / KEY / "simple" / "index.html").is_file()
    (site / "stale.html").write_text("from the last build")
    assert run(["index", "build", str(project / "wheelhouse"), "--out", str(site)], capsys)[0] == 0
    assert not (site / "stale.html").exists()  # replaced as a whole
    assert sorted(p.name for p in project.iterdir()) == ["docs", "site", "train.py", "wheelhouse"]  # no .site.old


def test_stage_folders_of_a_killed_run_are_cleaned_and_foreign_ones_kept(project: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ours = project / ".site.abc123"
    ours.mkdir()
    (ours / index.SITE_MARKER).write_text("x")
    (ours / "big.whl").write_bytes(b"0" * 1000)
    theirs = project / ".site.backup"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    assert run(["index", "build", str(project / "wheelhouse"), "--out", str(project / "site")], capsys)[0] == 0
    assert not ours.exists() and (theirs / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("report", [
    {"ok": True, "cell": "../../../../tmp/x/evil"}, {"ok": True, "cell": "a/b"}, {"ok": True}, [],
    {"ok": "no", "cell": "c"}, {"ok": True, "cell": "c", "problems": [1, 2]}, {"ok": True, "cell": "x\n"},
])
def test_hostile_verification_records_are_refused_in_one_line(project: Path, report: object,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    house = project / "wheelhouse"
    whl = next(house.glob("*.whl"))
    rep = report if not isinstance(report, dict) else {**report, "sha256": hashlib.sha256(whl.read_bytes()).hexdigest()}
    verification_path(whl).write_text(json.dumps(rep))
    before = snapshot(project.parent.parent)
    code, err = run(["index", "build", str(house), "--out", str(project / "site")], capsys)
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err and ".verify.json" in err
    assert snapshot(project.parent.parent) == before


@pytest.mark.parametrize("damage", ["empty", "not_zip", "dir", "bad_name"])
def test_damaged_wheels_are_named_in_one_line(project: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    house = project / "wheelhouse"
    name = {"bad_name": "not-a-wheel.whl"}.get(damage, f"demo_pkg-2.0+{KEY}-cp311-cp311-linux_x86_64.whl")
    bad = house / name
    if damage == "dir":
        bad.mkdir()
    else:
        bad.write_bytes(b"" if damage == "empty" else b"this is no zip")
        rep = {"ok": True, "cell": "torch2.11-cu130-py311", "sha256": hashlib.sha256(bad.read_bytes()).hexdigest()}
        verification_path(bad).write_text(json.dumps(rep))
    code, err = run(["index", "build", str(house), "--out", str(project / "site")], capsys)
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err and name in err
    assert not (project / "site").exists()


@pytest.mark.parametrize("url", ["javascript:alert(1)//", "file:///etc/", "ftp://x/", "https://x/\"><script>", "//x/"])
def test_base_url_must_be_http(project: Path, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["index", "build", str(project / "wheelhouse"), "--out", str(project / "site"), "--base-url", url],
                    capsys)
    assert code == 2 and "--base-url" in err and len(err.splitlines()) == 1
    assert not (project / "site").exists()


@pytest.mark.parametrize("label", ["evil", "cpu", f"{KEY}.evil", "cu13torch2.11"])
def test_only_labels_of_the_pipeline_become_index_keys(project: Path, label: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A verified wheel whose local label the pipeline never writes would become an index of its own: refused,
    in one line naming the wheel; the pipeline's test-build labels (arch subset, trim) still index."""
    house = project / "wheelhouse"
    bad = verified(make_wheel(house, name="other_pkg", version=f"1.0+{label}"))
    code, err = run(["index", "build", str(house), "--out", str(project / "site")], capsys)
    assert code == 1 and len(err.splitlines()) == 1 and bad.name in err and "not a label" in err
    assert not (project / "site").exists()
    bad.unlink()
    verified(make_wheel(house, name="other_pkg", version=f"1.0+{KEY}.sm90.trim0123abcd"))
    code, err = run(["index", "build", str(house), "--out", str(project / "site")], capsys)
    assert code == 0, err
    assert (project / "site" / f"{KEY}.sm90.trim0123abcd" / "simple").is_dir()  # its own key: never the cell's


def test_pipeline_labels_are_exactly_what_naming_writes() -> None:
    from attnkit.matrix import naming as n

    trim = n.options_marker((("FLASH_ATTENTION_DISABLE_FP8", "TRUE"),))
    written = [n.wheel_local_version("13.0", "2.11", True), n.wheel_local_version("12.6", "2.8", False, "sm90"),
               n.wheel_local_version("12.6", "2.8", False, "sm80sm90") + f".{trim}",
               n.stable_local_version("13.0", "2.9", ["8.0", "9.0+PTX"]),
               n.stable_local_version("13.0", "2.9", ["9.0"], trim)]
    assert all(n.is_pipeline_label(x) for x in written), written
    for odd in ("evil", f"{KEY}.evil", "cpu", "cu13torch2.11", f"{KEY}.trimXYZ", "cu\uff11\uff13torch2.11cxx11abiTRUE",
                f"{KEY}\n", "cu13torch2.9stable", f"{KEY}.{trim}.sm90", "cu13torch2.9stable.sm90.sm80",
                KEY.lower(), KEY.upper(), "cu013torch02.011cxx11abiTRUE", f"{KEY}.SM90PTX", f"{KEY}.trim0123ABCD",
                "cu13torch2.11cxx11abiTrue"):
        assert not n.is_pipeline_label(odd), odd
    assert n.parse_local_version("cu\uff11\uff13torch2.11cxx11abiTRUE") is None  # ASCII digits only


def test_a_trimmed_stable_abi_label_still_needs_the_abi3_tag(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    house = project / "wheelhouse"
    bad = verified(make_wheel(house, name="other_pkg", version="1.0+cu13torch2.9stable.sm90.trim0123abcd"))
    code, err = run(["index", "build", str(house), "--out", str(project / "site")], capsys)
    assert code == 1 and bad.name in err and "not tagged abi3" in err and not (project / "site").exists()
