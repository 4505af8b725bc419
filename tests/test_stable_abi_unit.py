"""Stable-ABI (abi3) wheels as a kind of package, the pure parts: names, the matrix rule (one wheel and one build
job per CUDA major), verification helpers, the index's keys and the installer's pick. The real build, installs and
refusal are in tests/test_stable_abi_wheel.py (e2e)."""

from __future__ import annotations

import json
import zipfile

import pytest
from test_wheels_unit import env
from wheelkit import make_wheel, verified

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.matrix import naming
from attnkit.wheels import index, resolve, verify
from attnkit.wheels.recipe import load_recipe

STABLE = "cu13torch2.13stable.sm80sm90"
WHL = f"demo_pkg-1.0+{STABLE}-cp39-abi3-linux_x86_64.whl"


def test_stable_names_say_cuda_major_torch_floor_archs_and_abi3():
    name = naming.stable_wheel_filename("flash-attn-3", "3.0.0", cuda="13.2", min_torch="2.9", min_python="3.10",
                                        archs=["80", "9.0"])
    assert name == "flash_attn_3-3.0.0+cu13torch2.9stable.sm80sm90-cp310-abi3-linux_x86_64.whl"
    from packaging.utils import parse_wheel_filename

    _, version, _, tags = parse_wheel_filename(name)  # a valid wheel name, PEP 440 local label
    assert version.local == "cu13torch2.9stable.sm80sm90" and {str(t) for t in tags} == {"cp310-abi3-linux_x86_64"}
    assert naming.parse_stable_local("CU13TORCH2.9STABLE.SM80SM90PTX") == ("cu13", "2.9", ("sm80", "sm90ptx"))
    assert naming.parse_local_version("cu13torch2.9stable.sm90") is None  # never an environment key itself
    assert naming.parse_stable_local("cu13torch2.11cxx11abiTRUE") is None
    assert naming.arch_token("9.0+PTX") == "sm90ptx" and naming.arch_token(100) == "sm100"
    with pytest.raises(ValueError, match="arch 'sm90'"):
        naming.arch_token("sm90")
    with pytest.raises(ValueError, match="names its archs"):
        naming.stable_local_version("13.0", "2.9", [])
    serves = {k: naming.stable_serves("cu13torch2.9stable.sm90", k) for k in (
        "cu13torch2.9cxx11abiTRUE", "cu13torch2.15cxx11abiFALSE", "cu13torch2.8cxx11abiTRUE", "cu12torch2.14cxx11abiTRUE")}
    assert serves == {"cu13torch2.9cxx11abiTRUE": True, "cu13torch2.15cxx11abiFALSE": True,
                      "cu13torch2.8cxx11abiTRUE": False, "cu12torch2.14cxx11abiTRUE": False}


def test_torch_floor_and_abi3_checks(tmp_path):
    assert verify.check_torch_floor(["torch>=2.13", "numpy"], "2.13") == []
    assert "is not 'torch>=2.13'" in verify.check_torch_floor(["torch<2.15,>=2.14"], "2.13")[0]
    assert "is not 'torch>=2.13'" in verify.check_torch_floor(["torch>=2.12"], "2.13")[0]
    assert verify.check_torch_floor(["numpy"], "2.13") == ["METADATA does not require torch"]
    good = make_wheel(tmp_path, version=f"1.0+{STABLE}", tag="cp39-abi3-linux_x86_64")
    wheel_file = "Wheel-Version: 1.0\nTag: cp39-abi3-linux_x86_64\n"
    assert verify.check_abi3(good, ["demo_pkg/_C.abi3.so"], "3.9", wheel_file) == []
    problems = verify.check_abi3(good, ["demo_pkg/_C.cpython-311-x86_64-linux-gnu.so"], "3.10",
                                 "Tag: cp311-cp311-linux_x86_64\n")
    assert problems[0] == "tagged cp39-abi3-linux_x86_64; a stable-ABI wheel is cp310-abi3"
    assert problems[1].startswith("WHEEL says Tag cp311-cp311-linux_x86_64, the file name cp39-abi3")
    assert problems[2].startswith("demo_pkg/_C.cpython-311-x86_64-linux-gnu.so is built for one CPython")


def test_stable_symbol_check_names_cxx_symbols_and_wants_the_c_shim():
    ok, info = verify.check_stable_symbols({"a.so": ["aoti_torch_get_numel", "torch_library_impl", "memcpy",
                                                     "std::__throw_bad_alloc()"]})
    assert ok == [] and info["a.so"] == {"torch_cxx": [], "c_shim": ["aoti_torch_get_numel", "torch_library_impl"]}
    cxx = ["c10::Error::Error(c10::SourceLocation, std::string)", "at::Tensor::print() const",
           "torch::Library::_def(...)", "caffe2::TypeMeta::x", "aoti_torch_get_numel"]
    bad, info = verify.check_stable_symbols({"b.so": cxx})
    assert bad == ["b.so needs torch's C++ ABI, which a stable-ABI wheel must not: at::Tensor::print() const; "
                   "c10::Error::Error(c10::SourceLocation, std::string); caffe2::TypeMeta::x (+1 more)"]
    none, _ = verify.check_stable_symbols({"c.so": ["memcpy"]})
    assert none == ["no shared object uses torch's stable C shim (aoti_torch_* / torch_*): not a stable-ABI build"]


def test_a_stable_recipe_needs_its_floors_in_one_line(tmp_path, capsys):
    bad = tmp_path / "r.toml"
    bad.write_text('name = "x"\nextension_modules = ["x._C"]\n[source]\npath = "."\nversion = "1"\narchs = ["9.0"]\n'
                   'abi = "stable"\n[build]\narch_env = "A"\narch_format = "sm-semicolon"\nmemory_per_job_gib = 1\n')
    with pytest.raises(AttnkitError) as exc:
        load_recipe(path=bad)
    msg = str(exc.value)
    assert msg.startswith(f"{bad}: source: ") and "abi 'stable' needs min_torch" in msg and "\n" not in msg
    bad.write_text(bad.read_text().replace('abi = "stable"', 'abi = "stable"\nmin_torch = "2.9"\nmin_python = "3.9"'))
    assert load_recipe(path=bad)[0].source.min_torch == "2.9"  # type: ignore[union-attr]


def _house(tmp_path, *versions_tags):
    house = tmp_path / "house"
    house.mkdir(parents=True, exist_ok=True)
    for v, t in versions_tags:
        verified(make_wheel(house, version=v, tag=t, requires=("torch>=2.13",), requires_python=">=3.9"))
    return house


def test_index_lists_a_stable_wheel_under_every_key_it_serves(tmp_path, matrix):
    house = _house(tmp_path, (f"1.0+{STABLE}", "cp39-abi3-linux_x86_64"),
                   ("1.0+cu12torch2.11cxx11abiTRUE", "cp311-cp311-linux_x86_64"))
    out = tmp_path / "site"
    entries = index.build_index(house, out, matrix=matrix)
    keys = sorted({e.key for e in entries if e.filename == WHL})
    # matrix.yaml: torch 2.13, 2.14 and 2.15 ship a CUDA 13.x build; 2.12 is below the floor; cu12 is another major
    assert keys == ["cu13torch2.13cxx11abiTRUE", "cu13torch2.14cxx11abiTRUE", "cu13torch2.15cxx11abiTRUE"]
    for k in keys:
        assert WHL.replace("+", "%2B") in (out / k / "simple" / "demo-pkg" / "index.html").read_text()
    assert WHL not in (out / "cu12torch2.11cxx11abiTRUE" / "simple" / "demo-pkg" / "index.html").read_text()
    assert WHL.replace("+", "%2B") in (out / "stable" / "simple" / "demo-pkg" / "index.html").read_text()
    assert sorted(p.name for p in (out / "files").glob("*.whl")) == sorted(p.name for p in house.glob("*.whl"))
    # without a matrix: only the keys of the other wheels indexed that it serves
    house2 = _house(tmp_path / "b", (f"1.0+{STABLE}", "cp39-abi3-linux_x86_64"),
                    ("1.0+cu13torch2.14cxx11abiTRUE", "cp311-cp311-linux_x86_64"),
                    ("1.0+cu13torch2.12cxx11abiTRUE", "cp311-cp311-linux_x86_64"))
    entries = index.build_index(house2, tmp_path / "site2")
    assert sorted(e.key for e in entries if e.filename == WHL) == ["cu13torch2.14cxx11abiTRUE"]


def test_index_refuses_a_stable_wheel_it_cannot_place(tmp_path, capsys, matrix):
    house = _house(tmp_path, ("1.0+cu11torch2.13stable.sm80", "cp39-abi3-linux_x86_64"))
    with pytest.raises(AttnkitError, match=r"serves no index key: no torch >= 2.13 with CUDA 11.x in the matrix"):
        index.build_index(house, tmp_path / "s", matrix=matrix)
    house = _house(tmp_path / "c", (f"1.0+{STABLE}", "cp311-cp311-linux_x86_64"))
    assert main(["index", "build", str(house), "--out", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert "a stable-ABI label (+cu13torch2.13stable.sm80sm90) on a wheel not tagged abi3" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "s").exists()


def test_install_picks_the_stable_wheel_where_no_cell_wheel_exists(tmp_path, matrix):
    house = _house(tmp_path, (f"1.0+{STABLE}", "cp39-abi3-linux_x86_64"),
                   ("1.0+cu13torch2.14stable.sm90", "cp39-abi3-linux_x86_64"),
                   ("0.9+cu13torch2.14cxx11abiTRUE", "cp311-cp311-linux_x86_64"))
    site = tmp_path / "site"
    index.build_index(house, site, matrix=matrix)

    def pick(torch: str, python: str = "3.11", cuda: str = "13.0") -> str:
        e = env(torch=torch, python=python, cuda=cuda)
        simple = resolve.index_url(str(site), e)
        try:
            cands = resolve.listing(simple, "demo-pkg")
        except AttnkitError:
            cands = []
        return resolve.choose(cands, e, "demo-pkg", resolve.stable_listing(str(site), "demo-pkg")).filename

    assert pick("2.14.1+cu130") == "demo_pkg-0.9+cu13torch2.14cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"  # its own
    assert pick("2.13.0+cu130") == WHL  # no cell wheel for 2.13: the stable one (2.14's floor is too high)
    assert pick("2.15.0+cu132", python="3.14") == WHL  # most archs wins among the stable wheels; any Python >= 3.9
    with pytest.raises(AttnkitError) as exc:
        pick("2.12.1+cu130")
    assert str(exc.value) == (f"demo-pkg: its stable-ABI wheel {WHL} needs torch >= 2.13; this environment has torch "
                              "2.12.1+cu130 (+cu13torch2.12cxx11abiTRUE), below that floor, and no demo-pkg wheel is "
                              "built for torch 2.12: upgrade torch to 2.13 or newer")
    with pytest.raises(AttnkitError, match=r"no demo-pkg wheel fits .*nearest: .*\(stable ABI for cu13 torch >= 2.1"):
        resolve.choose(resolve.stable_listing(str(site), "demo-pkg"), env(torch="2.14.1+cu128", cuda="12.8"),
                       "demo-pkg")
    with pytest.raises(AttnkitError, match="tags cp39-abi3-linux_x86_64"):  # an abi3 wheel is not for Python 3.8
        resolve.choose(resolve.stable_listing(str(site), "demo-pkg"), env(torch="2.13.0+cu130", python="3.8"),
                       "demo-pkg")


def test_verify_report_in_index_json_keeps_one_entry_per_key(tmp_path, matrix):
    house = _house(tmp_path, (f"1.0+{STABLE}", "cp39-abi3-linux_x86_64"))
    index.build_index(house, tmp_path / "site", matrix=matrix)
    rows = json.loads((tmp_path / "site" / "index.json").read_text())
    assert [r["key"] for r in rows] == ["cu13torch2.13cxx11abiTRUE", "cu13torch2.14cxx11abiTRUE",
                                        "cu13torch2.15cxx11abiTRUE"]
    assert {r["filename"] for r in rows} == {WHL}
    with zipfile.ZipFile(house / WHL) as z:
        assert "Requires-Dist: torch>=2.13" in z.read(f"demo_pkg-1.0+{STABLE}.dist-info/METADATA").decode()
