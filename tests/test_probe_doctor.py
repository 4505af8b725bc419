"""The probe and doctor on this machine (real, no fakes), and their JSON."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main


def test_probe_is_cached_and_immutable():
    from attnkit.runtime.probe import probe

    p = probe()
    assert p is probe()
    with pytest.raises(AttributeError):
        p.python = "x"  # type: ignore[misc]
    assert p.python.count(".") == 2
    names = [lib.name for lib in p.libraries]
    assert names == ["flash-attn", "flash-attn-3", "xformers"]


def test_doctor_json(capsys):
    rc = main(["doctor", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) >= {"probe", "backends", "shapes", "healthy"}
    assert set(rep["backends"]) >= {"sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn2",
                                     "flash_attn3", "xformers"}
    if rep["probe"]["torch"] is None:
        assert all(not b["available"] for b in rep["backends"].values())
    else:
        assert rep["backends"]["sdpa_math"]["available"]
    if not rep["probe"]["gpus"]:
        assert rc == 0 and rep["healthy"]
    lib = next(b for b in rep["probe"]["libraries"] if b["name"] == "flash-attn")
    if not lib["installed"]:
        assert rep["backends"]["flash_attn2"]["reasons"] == ["flash-attn is not installed"]


def test_doctor_table(capsys):
    main(["doctor"])
    out = capsys.readouterr().out
    assert "backends" in out and "sdpa_math" in out
