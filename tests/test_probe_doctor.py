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
    assert names == ["flash-attn", "flash-attn-3", "flash-attn-4", "xformers", "cudnn-frontend"]
    fa4 = p.library("flash-attn-4")
    assert fa4 is not None and fa4.checked is False  # deferred: never imported by the probe


def test_doctor_json(capsys):
    rc = main(["doctor", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) >= {"probe", "backends", "shapes", "healthy"}
    assert set(rep["backends"]) >= {"sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
                                     "flash_attn2", "flash_attn3", "flash_attn4", "xformers"}
    if rep["device"] == "cpu" and rep["probe"]["torch"] is not None:
        assert {s["decided_by"] for s in rep["shapes"].values()} == {"default: cpu order"}  # tables, rows: per GPU
        assert rep["shapes"]["train causal D128"]["backend"] == "sdpa_cpu"
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


def test_load_errors_are_one_line_and_keep_what_a_colon_announces():
    """xformers' error is 'built for:' then the versions on the next lines (seen on the H200 with PyPI's
    xformers 0.0.35 under torch 2.11+cu130, docs/results/2026-11-30-h200-doctor-pypi-xformers.txt)."""
    from attnkit.runtime.probe import _short

    xf = RuntimeError("xFormers can't load C++/CUDA extensions. xFormers was built for:\n"
                      "    PyTorch 2.10.0+cu128 with CUDA 1208 (you have 2.11.0+cu130)\n"
                      "    Python  3.10.19 (you have 3.12.3)\n  Please reinstall xformers")
    assert _short(xf) == ("RuntimeError: xFormers can't load C++/CUDA extensions. xFormers was built for: "
                          "PyTorch 2.10.0+cu128 with CUDA 1208 (you have 2.11.0+cu130) Python  3.10.19 (you have 3.12.3)")
    assert _short(ImportError("undefined symbol: _ZN3c10\nmore")) == "ImportError: undefined symbol: _ZN3c10"
    assert _short(OSError()) == "OSError:"
    assert len(_short(ValueError("x" * 1000))) == 300


def test_xformers_loads_next_to_the_flash_attn_namespace_of_flash_attn_4(tmp_path, monkeypatch):
    """xformers' flash module imports flash-attn 2 whenever find_spec('flash_attn') finds a package; with only
    FlashAttention-4 installed that is a bare namespace and the import failed on the H200. attnkit's loader
    hides the namespace for that import only (a stand-in xformers records what it saw)."""
    import importlib
    import importlib.util
    import sys

    from attnkit.runtime import loaders as xf

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)  # FA4's namespace package, no __init__.py
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    fmha = tmp_path / "xformers" / "ops" / "fmha"
    fmha.mkdir(parents=True)
    for d in (tmp_path / "xformers", tmp_path / "xformers" / "ops"):
        (d / "__init__.py").write_text("")
    (fmha / "__init__.py").write_text("import importlib.util\nSAW_FLASH_ATTN = importlib.util.find_spec('flash_attn')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    xf.load_fmha.cache_clear()
    try:
        assert importlib.util.find_spec("flash_attn") is not None  # the namespace is really there
        mod = xf.load_fmha()
        assert mod.SAW_FLASH_ATTN is None
        assert importlib.util.find_spec("flash_attn") is not None  # and only hidden during that import
    finally:
        xf.load_fmha.cache_clear()
        for name in [m for m in sys.modules if m.split(".")[0] in ("xformers", "flash_attn")]:
            del sys.modules[name]
