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
    assert verify.check_requires_python(">=3.9", "3.9") == [] and verify.check_requires_python(None, "3.9") == []
    assert verify.check_requires_python(">=3.10", "3.9") == [
        "Requires-Python '>=3.10' is not Python >= 3.9, the floor its abi3 tag says"]
    assert verify.check_requires_python(">=3.8", "3.10") != []
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
    assert verify.check_needed({"a.so": ["libtorch_cpu.so", "libc.so.6"]}) == []
    assert verify.check_needed({"b.so": ["libtorch_python.so"]}) == [
        "b.so links libtorch_python.so, torch's C++ Python bindings, which the stable ABI does not cover"]
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


def test_flash_attn_3_is_one_wheel_and_one_job_per_cuda_major(matrix, capsys):
    from attnkit.matrix.expand import all_cells

    cells = all_cells(matrix)
    fa3 = {c.id: c.package("flash-attn-3") for c in cells}
    carried = [cid for cid, p in fa3.items() if p is not None]
    # every CUDA cell of torch >= 2.9 (its floor) and Python >= 3.10; none of torch 2.8, none on CPU
    assert carried == [c.id for c in cells if c.cuda and c.torch != "2.8"]
    wheels = {p.wheel: p.built_in for p in fa3.values() if p is not None}
    assert wheels == {
        "flash_attn_3-3.0.0+cu12torch2.9stable.sm80sm90-cp310-abi3-linux_x86_64.whl": "torch2.11-cu128-py312",
        "flash_attn_3-3.0.0+cu13torch2.9stable.sm80sm90-cp310-abi3-linux_x86_64.whl": "torch2.11-cu130-py312"}
    assert all(p.abi == "stable" and p.min_torch == "2.9" for p in fa3.values() if p is not None)
    assert main(["matrix", "--format", "github", "--package", "flash-attn-3"]) == 0
    jobs = json.loads(capsys.readouterr().out)["include"]
    assert [(j["cell"], j["abi"], j["min_torch"], j["machine"]) for j in jobs] == [
        ("torch2.11-cu128-py312", "stable", "2.9", "x86_64"), ("torch2.11-cu130-py312", "stable", "2.9", "x86_64"),
        ("torch2.11-cu130-py312", "stable", "2.9", "aarch64")]  # the cu13 wheel for aarch64 too, on the arm runner
    arm = {c.package("flash-attn-3", "linux/arm64").wheel for c in cells if c.package("flash-attn-3", "linux/arm64")}
    assert arm == {"flash_attn_3-3.0.0+cu13torch2.9stable.sm80sm90-cp310-abi3-linux_aarch64.whl"}
    assert main(["matrix", "--format", "github", "--package", "flash-attn"]) == 0
    assert all(j["abi"] == "cell" and "min_torch" not in j for j in json.loads(capsys.readouterr().out)["include"])


@pytest.mark.parametrize("edit, where, says", [
    ('    wheel_tag: abi3\n', "packages.flash-attn-3.wheel_tag", "allowed: 'abi3'"),
    ('    min_python: "3.10"', "packages.flash-attn-3.abi", "abi: stable needs min_python"),
    ('    abi: stable ', "packages.flash-attn-3.wheel_tag", "'abi3' is for abi: stable packages"),
    ('    git:  ', "packages.flash-attn-3", "give its source as sdist (url, sha256) or git (url, commit)"),
])
def test_stable_package_mistakes_are_one_line(tmp_path, capsys, edit, where, says):
    from attnkit.matrix.load import default_matrix_path

    text = default_matrix_path().read_text()
    start = text.index("  flash-attn-3:\n")
    block = text[start:text.index("\n# Attention libraries used as published", start)]
    if edit.startswith("    wheel_tag"):
        new = block.replace(edit, "    wheel_tag: cpython\n")
    elif edit.startswith("    min_python"):
        new = block.replace(edit, "   ")  # dropped (a comment-only line stays)
    elif edit.startswith("    abi:"):
        new = block.replace("    abi: stable ", "    abi: cell   ")
    else:
        new = block.replace("    git:  ", "    sdist: {url: 'https://x.org/a.tar.gz', sha256: '" + "0" * 64 + "'}\n    git:  ")
    assert new != block
    bad = tmp_path / "m.yaml"
    bad.write_text(text.replace(block, new))
    assert main(["matrix", "--file", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"attnkit: error: {bad}:") and f": {where}: " in err[0], err
    assert says in err[0]


def test_fa3_recipe_arch_switch_and_trim_options(matrix):
    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.compile import recipe_env
    from attnkit.wheels.recipe import format_archs, parse_arch, resolve, restrict, with_options

    recipe, path = load_recipe("flash-attn-3")
    spec = resolve(matrix, find_cell(matrix, "torch2.11-cu130-py312"), recipe, path)
    assert spec.abi == "stable" and spec.git is not None and spec.sdist_url is None
    assert spec.wheel_filename("x86_64") == "flash_attn_3-3.0.0+cu13torch2.9stable.sm80sm90-cp310-abi3-linux_x86_64.whl"
    assert recipe_env(spec, 4)["FLASH_ATTENTION_DISABLE_SM80"] == "FALSE"
    trimmed = with_options(restrict(spec, "90"), ["FLASH_ATTENTION_DISABLE_FP8=TRUE", "FLASH_ATTENTION_DISABLE_SPLIT=TRUE"])
    env = recipe_env(trimmed, 4)
    assert env["FLASH_ATTENTION_DISABLE_SM80"] == "TRUE" and env["FLASH_ATTENTION_DISABLE_FP8"] == "TRUE"
    name = trimmed.wheel_filename("x86_64")
    marker = naming.options_marker((("FLASH_ATTENTION_DISABLE_FP8", "TRUE"), ("FLASH_ATTENTION_DISABLE_SPLIT", "TRUE")))
    assert name == f"flash_attn_3-3.0.0+cu13torch2.9stable.sm90.{marker}-cp310-abi3-linux_x86_64.whl"
    assert naming.parse_stable_local(name.split("+")[1].split("-")[0]) is None  # never served as the full wheel
    assert with_options(spec, ["FLASH_ATTENTION_DISABLE_SPLIT=TRUE", "FLASH_ATTENTION_DISABLE_FP8=TRUE"]
                        ).wheel_filename("x86_64").split("sm80sm90.")[1].startswith(marker)  # order does not matter
    with pytest.raises(AttnkitError, match=r"--option 'FLASH_ATTENTION_DISABLE_SM80=TRUE': expected NAME=VALUE with"):
        with_options(spec, ["FLASH_ATTENTION_DISABLE_SM80=TRUE"])  # the arch switch is --archs' business
    with pytest.raises(AttnkitError, match=r"--option 'FLASH_ATTENTION_DISABLE_FP8': expected NAME=VALUE"):
        with_options(spec, ["FLASH_ATTENTION_DISABLE_FP8"])
    with pytest.raises(AttnkitError, match="builds sm_90 always and sm_80 optionally"):
        format_archs([parse_arch("80")], "disable-sm80")


def _git(*args, cwd=None):
    import subprocess

    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd or "."), "PATH": "/usr/bin:/bin"})


def _commit_of(repo):
    import subprocess

    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_git_source_is_its_pinned_paths_and_the_submodule_upstream_records(matrix, tmp_path, monkeypatch):
    """Real git: a superproject with a gitlink and a submodule repository, served from bare mirrors."""
    import dataclasses

    from attnkit.matrix.expand import find_cell
    from attnkit.matrix.schema import GitSource, GitSubmodule
    from attnkit.wheels.recipe import resolve
    from attnkit.wheels.source import ENV_GIT_MIRRORS, prepare_source, source_digest

    sub = tmp_path / "sub"
    (sub / "include" / "cute").mkdir(parents=True)
    (sub / "include" / "cute" / "tensor.hpp").write_text("// cute\n")
    (sub / "media.png").write_bytes(b"big")
    _git("init", "-q", str(sub), cwd=tmp_path)
    _git("add", "-A", cwd=sub)
    _git("commit", "-qm", "sub", cwd=sub)
    sub_commit = _commit_of(sub)
    sup = tmp_path / "sup"
    (sup / "hopper").mkdir(parents=True)
    (sup / "hopper" / "setup.py").write_text("# setup\n")
    (sup / "README.md").write_text("readme\n")
    (sup / "assets.pdf").write_bytes(b"big")
    _git("init", "-q", str(sup), cwd=tmp_path)
    _git("add", "-A", cwd=sup)
    _git("update-index", "--add", "--cacheinfo", f"160000,{sub_commit},csrc/cutlass", cwd=sup)
    _git("commit", "-qm", "sup", cwd=sup)
    sup_commit = _commit_of(sup)
    mirrors = tmp_path / "mirrors"
    _git("clone", "-q", "--bare", str(sup), str(mirrors / "o" / "sup.git"), cwd=tmp_path)
    _git("clone", "-q", "--bare", str(sub), str(mirrors / "o" / "sub.git"), cwd=tmp_path)
    monkeypatch.setenv(ENV_GIT_MIRRORS, str(mirrors))

    recipe, path = load_recipe("flash-attn-3")
    spec = resolve(matrix, find_cell(matrix, "torch2.11-cu130-py312"), recipe, path)
    git = GitSource(url="https://github.com/o/sup.git", commit=sup_commit, subdir="hopper", paths=["hopper", "README.md"],
                    submodules={"csrc/cutlass": GitSubmodule(url="https://github.com/o/sub.git", commit=sub_commit,
                                                             paths=["include"])})
    spec = dataclasses.replace(spec, git=git)
    build = tmp_path / "build"
    src = prepare_source(spec, build, tmp_path / "cache")
    assert src == build / "src" / "hopper" and (src / "setup.py").read_text() == "# setup\n"
    tree = sorted(str(p.relative_to(build / "src")) for p in (build / "src").rglob("*") if p.is_file())
    assert tree == ["README.md", "csrc/cutlass/include/cute/tensor.hpp", "hopper/setup.py"]  # only the pinned paths
    assert (build / ".source-digest").read_text().strip() == source_digest(spec)
    assert source_digest(spec).startswith("git:")
    other = dataclasses.replace(spec, git=git.model_copy(update={"paths": ["hopper"]}))
    assert source_digest(other) != source_digest(spec)  # what is taken of the tree is part of what is built
    wrong = "0" * 39 + "1"
    bad = dataclasses.replace(spec, git=git.model_copy(update={"submodules": {"csrc/cutlass": GitSubmodule(
        url="https://github.com/o/sub.git", commit=wrong, paths=["include"])}}))
    with pytest.raises(AttnkitError) as exc:
        prepare_source(bad, tmp_path / "build2", tmp_path / "cache")
    assert str(exc.value) == (f"git source: https://github.com/o/sup.git@{sup_commit[:12]} records csrc/cutlass at "
                              f"{sub_commit}, matrix.yaml pins {wrong}: pin the commit upstream records")


def test_the_shard_shim_counts_a_setup_pys_own_compile_rules():
    from attnkit.wheels.shards import COMPILE_RULE

    for rule in ("compile", "cuda_compile", "cuda_compile_sm80", "cuda_compile_sm80_sm90", "cuda_compile_sm100"):
        assert COMPILE_RULE.match(rule), rule
    for rule in ("link", "cuda_dlink", "phony", "compile_commands"):
        assert not COMPILE_RULE.match(rule), rule


def test_an_image_takes_the_stable_wheel_or_its_marked_test_build(matrix, tmp_path):
    from attnkit.images import wheelhouse
    from attnkit.matrix.expand import find_cell

    fa3 = find_cell(matrix, "torch2.14-cu130-py313").package("flash-attn-3")  # a cell that does not build it
    assert fa3 is not None and fa3.built_in == "torch2.11-cu130-py312"
    house = tmp_path / "h"
    house.mkdir()
    trimmed = verified(make_wheel(house, "flash_attn_3", "3.0.0+cu13torch2.9stable.sm90.trim2b842b4f",
                                  "cp310-abi3-linux_x86_64"))
    verified(make_wheel(house, "flash_attn_3", "3.0.0+cu12torch2.9stable.sm90", "cp310-abi3-linux_x86_64"))  # cu12
    with pytest.raises(AttnkitError, match="or an --archs test build, with --test-builds"):
        wheelhouse.cell_wheel(fa3, house, test_builds=False)
    assert wheelhouse.cell_wheel(fa3, house, test_builds=True) == trimmed  # never the other CUDA major's
    full = verified(make_wheel(house, "flash_attn_3", "3.0.0+cu13torch2.9stable.sm80sm90", "cp310-abi3-linux_x86_64"))
    assert full.name == fa3.wheel
    assert wheelhouse.cell_wheel(fa3, house, test_builds=True) == full  # the full wheel wins
