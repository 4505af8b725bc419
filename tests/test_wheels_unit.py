"""The wheel pipeline's pure parts: recipes, arch lists, parallelism, retag, arch/pin checks, index, resolve."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile

import pytest
from wheelkit import make_wheel, verified

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.wheels import index, resolve, retag, sizing, verify
from attnkit.wheels.pyenv import PyEnv
from attnkit.wheels.recipe import Arch, format_archs, load_recipe, parse_arch


def test_recipes_load_and_resolve_against_the_matrix(matrix):
    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.recipe import resolve as resolve_spec

    for name in ("flash-attn", "xformers"):
        recipe, path = load_recipe(name)
        spec = resolve_spec(matrix, find_cell(matrix, "torch2.11-cu130-py312"), recipe, path)
        assert spec.version == matrix.packages[name].version
        assert spec.sdist_sha256 == matrix.packages[name].sdist.sha256
    fa, p = load_recipe("flash-attn")
    spec = resolve_spec(matrix, find_cell(matrix, "torch2.12-cu126-py312"), fa, p)
    assert format_archs(list(spec.archs), fa.build.arch_format) == "80;90"  # 12.6 cannot build sm100/120
    spec = resolve_spec(matrix, find_cell(matrix, "torch2.11-cu128-py312"), fa, p)
    assert format_archs(list(spec.archs), fa.build.arch_format) == "80;90;100;120"
    with pytest.raises(AttnkitError, match=r"is shared and built in cell torch2\.11-cu128-py312"):
        resolve_spec(matrix, find_cell(matrix, "torch2.11-cu126-py312"), fa, p)


def test_recipe_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "r.toml"
    bad.write_text('name = "x"\nsource = "matrix"\nextension_modules = ["x"]\n[build]\narch_env = "A"\n'
                   'arch_format = "nope"\nmemory_per_job_gib = 1\n')
    assert main(["wheels", "env", "--recipe", str(bad), "--cell", "torch2.11-cu130-py312"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: build.arch_format" in err and len(err.strip().splitlines()) == 1
    bad.write_text('name = "x"\nsource = "matrix"\nextension_modules = ["x"]\n[build]\narch_env = "A"\n'
                   'arch_format = "sm-semicolon"\nmemory_per_job_gib = 1\n[build.unit_cost]\n"*bwd*" = 0\n')
    assert main(["wheels", "env", "--recipe", str(bad), "--cell", "torch2.11-cu130-py312"]) == 1
    err = capsys.readouterr().err
    assert "build.unit_cost" in err and "greater than 0" in err and len(err.strip().splitlines()) == 1
    bad.write_text("name = [")
    assert main(["wheels", "env", "--recipe", str(bad), "--cell", "torch2.11-cu130-py312"]) == 1
    assert "TOML syntax error" in capsys.readouterr().err
    with pytest.raises(AttnkitError, match="no recipe for 'nope'"):
        load_recipe("nope")


def test_arch_formats():
    archs = [parse_arch("8.0"), parse_arch("9.0+PTX"), parse_arch("120")]
    assert archs == [Arch(80), Arch(90, True), Arch(120)]
    assert format_archs(archs, "sm-semicolon") == "80;90;120"
    assert format_archs(archs, "dotted-semicolon") == "8.0;9.0+PTX;12.0"
    with pytest.raises(AttnkitError, match="arch 'sm_90'"):
        parse_arch("sm_90")


@pytest.mark.parametrize(
    ("cores", "mem", "threads", "per_job", "expected", "limit"),
    [
        (16, 125.0, 1, 5.0, 16, "cores"),  # the H200 machine, flash-attn at NVCC_THREADS=1
        (16, 40.0, 1, 5.0, 8, "memory"),
        (2, 24.0, 1, 5.0, 2, "cores"),  # the CI machine
        (2, 3.0, 1, 5.0, 1, "memory"),  # never zero
        (64, 512.0, 4, 9.0, 16, "cores"),
    ],
)
def test_jobs_from_cores_and_memory(cores, mem, threads, per_job, expected, limit):
    jobs, why = sizing.choose_jobs(cores, mem, threads, per_job)
    assert jobs == expected and f"limited by {limit}" in why
    assert sizing.choose_jobs(cores, mem, threads, per_job, override=3) == (3, "set by --jobs")
    with pytest.raises(AttnkitError, match="--jobs: must be >= 1"):
        sizing.choose_jobs(cores, mem, threads, per_job, override=0)


def test_retag_sets_local_version_and_torch_pin(tmp_path):
    src = make_wheel(tmp_path)
    out = retag.retag(src, tmp_path / "out", "demo_pkg-1.0+cu13torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl", "2.11")
    assert out.name == "demo_pkg-1.0+cu13torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    meta = retag.read_metadata(out)
    assert meta["Version"] == ["1.0+cu13torch2.11cxx11abiTRUE"]
    assert meta["Requires-Dist"] == ["torch<2.12,>=2.11", "numpy"]
    assert verify.check_torch_pin(meta["Requires-Dist"], "2.11") == []
    with zipfile.ZipFile(out) as z:  # RECORD lists every file with its real hash
        names = set(z.namelist())
        assert "demo_pkg-1.0+cu13torch2.11cxx11abiTRUE.dist-info/RECORD" in names
        for line in z.read("demo_pkg-1.0+cu13torch2.11cxx11abiTRUE.dist-info/RECORD").decode().splitlines():
            n, h, size = line.split(",")
            if h:
                data = z.read(n)
                assert h == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert int(size) == len(data)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [out.name]  # no temp file left
    # pip accepts the result (metadata version == file name version)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                        str(tmp_path / "t"), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_retag_renames_data_and_edits_headers_only(tmp_path):
    """`.data/` follows the version (else uv installs the folder itself into site-packages); METADATA's body
    (the long description) is left byte for byte, even its lines that look like headers."""
    desc = "Version: 9.9 is what this README talks about\nFrom here on\nRequires-Dist: torch==1.0 (prose)\n"
    src = make_wheel(tmp_path, description=desc, requires=("torch>=2", "numpy"),
                     extra={"demo_pkg-1.0.data/scripts/demo-tool": b"#!python\nprint('tool ran')\n"})
    name = f"demo_pkg-1.0+{KEY11}-cp311-cp311-linux_x86_64.whl"
    out = retag.retag(src, tmp_path / "out", name, "2.11")
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        meta = z.read(f"demo_pkg-1.0+{KEY11}.dist-info/METADATA")
    assert f"demo_pkg-1.0+{KEY11}.data/scripts/demo-tool" in names
    assert not any(n.startswith("demo_pkg-1.0.") for n in names)
    head, _, body = meta.partition(b"\n\n")
    assert body == desc.encode()
    assert b"Version: 1.0+" + KEY11.encode() in head and b"Version: 9.9" not in head
    assert head.count(b"Requires-Dist: torch") == 1 and b"Requires-Dist: torch<2.12,>=2.11" in head
    from wheel.wheelfile import WheelFile

    with WheelFile(out) as wf:  # RECORD rewritten: every member reads back against its hash
        for info in wf.infolist():
            wf.read(info)
    venv = tmp_path / "uvvenv"
    uv = resolve.find_uv()
    assert uv, "uv is a test dependency (noxfile TEST_DEPS)"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    r = subprocess.run([uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--no-deps", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    site = next((venv / "lib").glob("python3.*/site-packages"))
    assert not list(site.glob("*.data")), "the .data folder was installed as a package folder"
    ran = subprocess.run([str(venv / "bin" / "demo-tool")], capture_output=True, text=True)
    assert ran.stdout.strip() == "tool ran"


def test_retag_refuses_a_wheel_whose_files_do_not_match_its_record(tmp_path):
    src = make_wheel(tmp_path)
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["demo_pkg/__init__.py"] = b"VALUE = 666\n"  # changed after RECORD was written
    with zipfile.ZipFile(src, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(AttnkitError, match=r"retag: demo_pkg-1.0-cp311-cp311-linux_x86_64.whl: .*[Hh]ash mismatch"):
        retag.retag(src, tmp_path / "out", f"demo_pkg-1.0+{KEY11}-cp311-cp311-linux_x86_64.whl", "2.11")
    assert not list((tmp_path / "out").iterdir())


def test_import_check_loads_torch_operator_libraries(tmp_path):
    """xformers' _C.so has no PyInit: verify loads it with torch.ops.load_library, so a library that cannot
    load (here: not an ELF file) fails the check, while importing the package alone would pass."""
    pytest.importorskip("torch")
    whl = make_wheel(tmp_path, extra={"demo_pkg/_C.so": b"not a shared object"})
    args = (whl, sys.executable, ["demo_pkg"], "demo-pkg")
    assert verify.check_import(*args, tmp_path / "a") == []
    problems = verify.check_import(*args, tmp_path / "b", libraries=("demo_pkg._C",))
    assert len(problems) == 1 and problems[0].startswith("import failed:") and "_C.so" in problems[0], problems
    missing = verify.check_import(*args, tmp_path / "c", libraries=("demo_pkg._missing",))
    assert len(missing) == 1 and "demo_pkg._missing: not in the wheel" in missing[0], missing


def test_retag_refuses_other_tags_or_versions(tmp_path):
    src = make_wheel(tmp_path)
    with pytest.raises(AttnkitError, match="tagged cp311-cp311-linux_x86_64, the cell needs cp312"):
        retag.retag(src, tmp_path / "o", "demo_pkg-1.0+cu13torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64.whl", "2.11")
    with pytest.raises(AttnkitError, match=r"built version 1\.0 is not 2\.0"):
        retag.retag(src, tmp_path / "o", "demo_pkg-2.0+cu13torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl", "2.11")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_torch_pin_check():
    assert verify.check_torch_pin(["torch>=2.11,<2.12"], "2.11") == []
    assert "does not pin" in verify.check_torch_pin(["torch>=2.10"], "2.11")[0]
    assert "does not pin" in verify.check_torch_pin(["torch"], "2.11")[0]
    assert verify.check_torch_pin(["numpy"], "2.11") == ["METADATA does not require torch"]


def test_arch_coverage_check():
    assert verify.check_archs({"a.so": {"sm_80", "sm_90"}}, {"sm_80", "sm_90"}) == []
    assert verify.check_archs({"a.so": {"sm_80"}, "b.so": {"sm_90a"}}, {"sm_80", "sm_90"}) == []
    p = verify.check_archs({"a.so": {"sm_80"}}, {"sm_80", "sm_90", "sm_100"})
    assert p == ["no GPU code for sm_90, sm_100 (found sm_80)"]
    p = verify.check_archs({"a.so": {"sm_80", "sm_75"}}, {"sm_80"})
    assert p == ["a.so has GPU code for sm_75, not requested"]


KEY11, KEY12 = "cu13torch2.11cxx11abiTRUE", "cu13torch2.12cxx11abiTRUE"


def test_index_is_one_pep503_index_per_key_with_metadata(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    w1 = verified(make_wheel(house, version=f"1.0+{KEY11}"))
    w2 = verified(make_wheel(house, version=f"1.0+{KEY12}"), "torch2.12-cu130-py311")
    out = tmp_path / "site"
    assert main(["index", "build", str(house), "--out", str(out)]) == 0
    assert not (out / "simple").exists()  # no flat index over all keys
    for w, key, other in ((w1, KEY11, w2), (w2, KEY12, w1)):
        page = (out / key / "simple" / "demo-pkg" / "index.html").read_text()
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        quoted = w.name.replace("+", "%2B")
        assert f'href="../../../files/{quoted}#sha256={sha}"' in page  # '+' percent-encoded
        assert other.name not in page  # one key per index
        meta = (out / "files" / f"{w.name}.metadata").read_bytes()
        with zipfile.ZipFile(w) as z:  # PEP 658: the METADATA file, byte for byte, and its hash on the anchor
            assert meta == z.read(f"demo_pkg-1.0+{key}.dist-info/METADATA")
        msha = hashlib.sha256(meta).hexdigest()
        assert f'data-dist-info-metadata="sha256={msha}"' in page and f'data-core-metadata="sha256={msha}"' in page
        assert 'data-requires-python="&gt;=3.10"' in page
        assert (out / "files" / w.name).read_bytes() == w.read_bytes()
        assert '<a href="demo-pkg/">demo-pkg</a>' in (out / key / "simple" / "index.html").read_text()
    keys = json.loads((out / "keys.json").read_text())
    assert [k["key"] for k in keys] == [KEY11, KEY12]
    assert keys[0]["cuda"] == "cu13" and keys[0]["torch"] == "2.11" and keys[0]["cxx11_abi"] is True
    assert keys[0]["commands"]["demo-pkg"]["uv"] == f"uv pip install demo-pkg==1.0 --index {KEY11}/simple/"
    landing = (out / "index.html").read_text()
    assert f'href="{KEY11}/simple/"' in landing and "attnkit index key" in landing
    assert w1.name in (out / "cells" / "torch2.11-cu130-py311.html").read_text()
    assert w2.name not in (out / "cells" / "torch2.11-cu130-py311.html").read_text()
    # base URL: links to release assets, nothing copied but the .metadata files to upload beside them
    assert main(["index", "build", str(house), "--out", str(out), "--base-url", "https://x/y/",
                 "--site-url", "https://attnkit.github.io/attnkit"]) == 0
    assert f'href="https://x/y/{w1.name.replace("+", "%2B")}#sha256=' in (
        out / KEY11 / "simple" / "demo-pkg" / "index.html").read_text()
    assert sorted(p.name for p in (out / "files").iterdir()) == sorted(f"{w.name}.metadata" for w in (w1, w2))
    assert f"https://attnkit.github.io/attnkit/{KEY11}/simple/" in (out / "index.html").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["house", "site"]  # no stage dirs left behind


def test_index_refuses_unverified_changed_or_unlabelled_wheels(tmp_path, capsys):
    house = tmp_path / "h"
    house.mkdir()
    w = make_wheel(house, version=f"1.0+{KEY11}")
    assert main(["index", "build", str(house), "--out", str(tmp_path / "s")]) == 1
    assert "no verification report" in capsys.readouterr().err
    verified(w)
    with zipfile.ZipFile(w, "a") as z:
        z.writestr("extra.txt", "tampered")
    assert main(["index", "build", str(house), "--out", str(tmp_path / "s")]) == 1
    assert "the file changed after verification" in capsys.readouterr().err
    w.unlink()
    verified(make_wheel(house, version="1.0"))
    assert main(["index", "build", str(house), "--out", str(tmp_path / "s")]) == 1
    assert "no local version label" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def env(torch="2.11.0+cu130", cuda="13.0", python="3.11", glibc=(2, 35), machine="x86_64"):
    """What pyenv.describe() reads: the tags are packaging.tags' for that Python on a glibc machine."""
    from packaging import tags

    version = tuple(int(x) for x in python.split("."))
    plats = [f"manylinux_{glibc[0]}_{m}_{machine}" for m in range(glibc[1], 16, -1)] + [f"linux_{machine}"]
    ts = [*tags.cpython_tags(version, platforms=plats), *tags.compatible_tags(version, platforms=plats)]
    return PyEnv("/x/python", python, machine, torch, cuda, True, tuple(str(t) for t in ts), True)


def test_one_key_serves_x86_64_and_aarch64_and_each_interpreter_takes_its_own(tmp_path):
    """linux_aarch64 (GH200, GB200): the platform is in the wheel's tag, not in its local label, so both
    machines' wheels of a cell share the cell's index key, and the interpreter's own tags pick between them."""
    from attnkit.matrix import naming

    arm = naming.wheel_filename("demo-pkg", "1.0", cuda="13.0", torch="2.11", cxx11_abi=True, python="3.11",
                                wheel_tag="cpython", machine=naming.platform_machine("linux/arm64"))
    assert arm == f"demo_pkg-1.0+{KEY11}-cp311-cp311-linux_aarch64.whl"
    house = tmp_path / "h"
    house.mkdir()
    for machine in ("x86_64", "aarch64"):
        verified(make_wheel(house, version=f"1.0+{KEY11}", tag=f"cp311-cp311-linux_{machine}"))
    index.build_index(house, tmp_path / "site")
    cands = resolve.listing(resolve.index_url(str(tmp_path / "site"), env(machine="aarch64")), "demo-pkg")
    assert sorted(c.filename for c in cands) == sorted([arm, arm.replace("aarch64", "x86_64")])
    assert resolve.choose(cands, env(machine="aarch64"), "demo-pkg").filename == arm
    assert resolve.choose(cands, env(), "demo-pkg").filename.endswith("-linux_x86_64.whl")
    with pytest.raises(AttnkitError, match=r"nearest: .*tags cp311-cp311-linux_aarch64"):
        resolve.choose([c for c in cands if "aarch64" in c.filename], env(), "demo-pkg")


def test_resolve_picks_the_fitting_wheel_and_explains_misses(tmp_path):
    house = tmp_path / "h"
    house.mkdir()
    for v in (f"1.0+{KEY11}", f"1.1+{KEY11}", "1.1+cu12torch2.11cxx11abiTRUE", f"1.1+{KEY12}"):
        verified(make_wheel(house, version=v))
    # tags linux_x86_64 alone no longer decide: manylinux, abi3 and py3-none wheels fit too, per packaging.tags
    verified(make_wheel(house, version=f"1.2+{KEY11}", tag="cp311-abi3-manylinux_2_28_x86_64"))
    verified(make_wheel(house, version=f"1.3+{KEY11}", tag="cp312-cp312-manylinux_2_28_x86_64"))  # other Python
    verified(make_wheel(house, version=f"1.4+{KEY11}", tag="cp311-cp311-manylinux_2_39_x86_64"))  # newer glibc
    index.build_index(house, tmp_path / "site")
    simple = resolve.index_url(str(tmp_path / "site"), env())
    assert simple.endswith(f"/{KEY11}/simple/")
    cands = resolve.listing(simple, "demo-pkg")
    assert len(cands) == 5 and all(c.sha256 for c in cands)
    best = resolve.choose(cands, env(), "demo-pkg")
    assert best.filename == f"demo_pkg-1.2+{KEY11}-cp311-abi3-manylinux_2_28_x86_64.whl"
    assert best.url.startswith("file://") and "#" not in best.url
    assert resolve.choose(cands, env(glibc=(2, 39)), "demo-pkg").filename.startswith("demo_pkg-1.4+")
    assert resolve.choose(cands, env(python="3.12"), "demo-pkg").filename.startswith("demo_pkg-1.3+")
    other = resolve.listing(resolve.index_url(str(tmp_path / "site"), env(torch="2.12.0+cu130")), "demo-pkg")
    assert resolve.choose(other, env(torch="2.12.0+cu130"), "demo-pkg").filename.startswith(f"demo_pkg-1.1+{KEY12}")
    with pytest.raises(AttnkitError, match=r"no demo-pkg wheel fits .*\+cu13torch2.13.*nearest: .*torch 2.11 vs 2.13"):
        resolve.choose(cands, env(torch="2.13.0+cu130"), "demo-pkg")
    with pytest.raises(AttnkitError, match=r"nearest: .*tags cp311-cp311-linux_x86_64 \(this Python 3.10 takes"):
        resolve.choose(cands, env(python="3.10"), "demo-pkg")
    with pytest.raises(AttnkitError, match="CPU build"):
        resolve.choose(cands, env(torch="2.13.0+cpu", cuda=None), "demo-pkg")
    with pytest.raises(AttnkitError, match=r"--index: cannot read .*/cu13torch2.13cxx11abiTRUE/simple/demo-pkg/"):
        resolve.listing(resolve.index_url(str(tmp_path / "site"), env(torch="2.13.0+cu130")), "demo-pkg")


def test_arch_subset_builds_are_marked_and_never_resolved(matrix, tmp_path):
    from attnkit.matrix import naming
    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.recipe import resolve as resolve_spec
    from attnkit.wheels.recipe import restrict

    fa, p = load_recipe("flash-attn")
    spec = resolve_spec(matrix, find_cell(matrix, "torch2.11-cu130-py312"), fa, p)
    sub = restrict(spec, "90")
    assert [a.sm for a in sub.archs] == [90] and sub.arch_subset == "sm90"
    assert restrict(spec, "80;90;100;120") is spec
    with pytest.raises(AttnkitError, match=r"--archs 75: must be a non-empty subset of the cell's archs \(80;90;100;120\)"):
        restrict(spec, "75")
    name = naming.wheel_filename("flash-attn", "2.8.3.post2", cuda="13.0", torch="2.11", cxx11_abi=True,
                                 python="3.12", wheel_tag="cpython", arch_subset="sm90")
    assert name == "flash_attn-2.8.3.post2+cu13torch2.11cxx11abiTRUE.sm90-cp312-cp312-linux_x86_64.whl"
    house = tmp_path / "h"
    house.mkdir()
    verified(make_wheel(house, version=f"1.0+{KEY11}.sm90"))
    index.build_index(house, tmp_path / "site")
    assert not (tmp_path / "site" / KEY11).exists()  # its own key: never in the cell's index
    sub_index = tmp_path / "site" / f"{KEY11}.sm90" / "simple"
    with pytest.raises(AttnkitError, match="not an attnkit build for one environment"):
        resolve.choose(resolve.listing(str(sub_index), "demo-pkg"), env(), "demo-pkg")


def test_peak_memory_follows_a_growing_machine(monkeypatch):
    """Firecracker VMs grow MemTotal as memory is used: every sample must re-read it, so the peak is real."""
    import threading

    from attnkit.wheels import compile as b

    assert 0 < b.memory_used_gib() < 1 << 20
    readings = iter([10.0, 50.0, 140.0, 20.0])
    stop = threading.Event()
    monkeypatch.setattr(b, "memory_used_gib", lambda: next(readings, None))
    monkeypatch.setattr(stop, "wait", lambda timeout: False)
    out: list[float] = []
    b._watch_memory(stop, out)  # returns when the readings run out (None)
    assert max(out) == 140.0 and out == [10.0, 50.0, 140.0, 20.0]


def test_wheels_torch_names_the_cells_torch_build(capsys, monkeypatch):
    """`attnkit wheels torch`: PyPI's plain torch is one CUDA flavour, so each cell installs from its CUDA's index."""
    monkeypatch.delenv("ATTNKIT_TORCH_INDEX", raising=False)
    assert main(["wheels", "torch", "--cell", "torch2.11-cu126-py310", "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == {"cell": "torch2.11-cu126-py310", "python": "3.10", "requirement": "torch==2.11.0",
                    "index_url": "https://download.pytorch.org/whl/cu126"}
    assert main(["wheels", "torch", "--cell", "torch2.13-cpu-py311"]) == 0
    assert capsys.readouterr().out.strip() == "torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu"
    monkeypatch.setenv("ATTNKIT_TORCH_INDEX", "https://mirror.example/torch/cu130")
    assert main(["wheels", "torch", "--cell", "torch2.14-cu130-py312"]) == 0
    assert capsys.readouterr().out.strip() == "torch==2.14.1 --index-url https://mirror.example/torch/cu130"
    assert main(["wheels", "torch", "--cell", "torch2.14-cu999-py312"]) == 2  # the command line is wrong
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cell: unknown cell 'torch2.14-cu999-py312'" in err


def test_describe_reads_the_target_interpreter_not_attnkits(tmp_path):
    """The probe runs in the target and borrows attnkit's `packaging` alone: attnkit's own torch (this test
    venv has one) and pip must not leak into what it reports."""
    from attnkit.wheels.pyenv import describe

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = describe(str(tmp_path / "bare" / "bin" / "python"))
    assert bare.torch is None and bare.torch_dist is None and not bare.has_pip
    cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert f"{cp}-{cp}-manylinux_2_17_x86_64" in bare.tags and "py3-none-any" in bare.tags
    assert bare.tags.index(f"{cp}-abi3-linux_x86_64") < bare.tags.index("py3-none-any")
    with pytest.raises(AttnkitError, match="torch is not installed"):
        bare.index_key()


# -- sharded builds: the pure parts (the real builds are in tests/test_sharded_build.py) -------------------------

def _units(costs: dict[str, float]):
    from attnkit.wheels.shards import Unit

    return [Unit(output=f"<build>/{s}.o", source=s, command=f"nvcc -c <src>/{s}") for s in costs]


def test_shards_balance_by_cost_not_count():
    from attnkit.wheels.shards import split

    costs = {"bwd_a.cu": 4.0, "bwd_b.cu": 4.0, **{f"fwd_{i}.cu": 1.0 for i in range(8)}}
    patterns = {"bwd_*": 4.0}
    shards = split(_units(costs), 2, patterns, {})
    loads = [sum(c for _, c in s) for s in shards]
    assert loads == [8.0, 8.0] and sorted(len(s) for s in shards) == [5, 5]
    by_count_worst = split(_units(costs), 3, {}, {})  # no costs: every unit 1, 10 units over 3 shards
    assert [len(s) for s in by_count_worst] == [4, 3, 3]
    recorded = split(_units(costs), 2, patterns, {"fwd_0.cu": 30.0})  # a measurement beats the pattern
    assert {u.source: c for s in recorded for u, c in s}["fwd_0.cu"] == 30.0
    # a record of some units (seconds) puts the others' pattern costs on its scale (median s per cost unit),
    # instead of weighing 400 s of backward against a bare 1
    partial = split(_units(costs), 2, patterns, {"bwd_a.cu": 400.0, "fwd_0.cu": 100.0})
    assert {u.source: c for s in partial for u, c in s}["bwd_b.cu"] == 400.0
    assert [sum(c for _, c in s) for s in partial] == [800.0, 800.0]
    from attnkit.wheels.shards import plan_summary
    assert plan_summary(_units(costs), 2, patterns, {"bwd_a.cu": 400.0})["cost_from"] == ["default", "pattern", "recorded"]
    assert split(_units(costs), 2, patterns, {}) == split(list(reversed(_units(costs))), 2, patterns, {})


def test_object_keys_change_with_every_input():
    from attnkit.wheels.shards import unit_key

    (u,) = _units({"k.cu": 1.0})
    base = unit_key(u, "src1", "nvcc 13.0", "2.11.0+cu130")
    assert base == unit_key(u, "src1", "nvcc 13.0", "2.11.0+cu130")
    other_flags = type(u)(u.output, u.source, u.command + " -gencode=arch=compute_100,code=sm_100")
    assert len({base, unit_key(u, "src2", "nvcc 13.0", "2.11.0+cu130"), unit_key(u, "src1", "nvcc 13.1", "2.11.0+cu130"),
                unit_key(u, "src1", "nvcc 13.0", "2.12.0+cu130"), unit_key(other_flags, "src1", "nvcc 13.0", "2.11.0+cu130")}) == 5


def test_shard_argument_and_cost_record(tmp_path):
    from attnkit.errors import AttnkitError, UsageError
    from attnkit.wheels.shards import load_recorded, parse_shard

    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "2", "a/b", ""):
        with pytest.raises(UsageError, match="--shard: expected I/N"):
            parse_shard(bad)
    rec = tmp_path / "shard.json"
    rec.write_text(json.dumps({"shard": 1, "unit_seconds": {"a.cu": 12.5}}))
    assert load_recorded(rec) == {"a.cu": 12.5}
    build_report = tmp_path / "build.json"  # `wheels build --shard --report`: the shard's report nested
    build_report.write_text(json.dumps({"package": "p", "shard": {"unit_seconds": {"a.cu": 20.0, "b.cu": 3.0}}}))
    assert load_recorded([rec, build_report]) == {"a.cu": 20.0, "b.cu": 3.0}  # merged, the later file wins
    assert load_recorded([build_report, rec]) == {"a.cu": 12.5, "b.cu": 3.0}
    for bad in ("[1, 2]", '{"a.cu": -1}', '{"a.cu": "fast"}'):
        rec.write_text(bad)
        with pytest.raises(AttnkitError, match=r"^--costs .*: expected \{source: seconds >= 0\}"):
            load_recorded(rec)


def test_projected_wall_time():
    from attnkit.wheels.shards import project_wall

    seconds = {"bwd.cu": 100.0, **{f"f{i}.cu": 10.0 for i in range(20)}}  # 300 core-seconds
    one = project_wall(seconds, 1, cores=4, memory_gib=16, memory_per_job_gib=5)
    assert one["jobs"] == 3 and one["compile_s"] == 100.0  # 300 / 3 jobs = 100, and the longest unit is 100
    four = project_wall(seconds, 4, cores=4, memory_gib=16, memory_per_job_gib=5, archs=4, overhead_s=60)
    assert four["compile_s"] == 400.0 and four["wall_s"] == 460.0  # bounded by the backward unit x 4 archs


def test_jobs_follow_the_cgroup_memory_limit(tmp_path):
    from attnkit.wheels import sizing

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(str(16 << 30))
    (v2 / "memory.current").write_text(str(4 << 30))
    assert sizing.cgroup_available_gib(v2) == 12.0
    assert sizing.available_memory_gib(v2) <= 12.0
    (v2 / "memory.max").write_text("max")
    assert sizing.cgroup_available_gib(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(8 << 30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(2 << 30))
    assert sizing.cgroup_available_gib(v1) == 6.0
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1's "no limit"
    assert sizing.cgroup_available_gib(v1) is None
    assert sizing.cgroup_available_gib(tmp_path / "none") is None


def test_source_patches_apply_by_the_cells_torch_and_fail_loudly(matrix, tmp_path):
    """flash-attn's and xformers' recipes switch their pinned -std=c++17 to C++20 for torch >= 2.14 only; a patch
    whose text is gone from the source is an error naming the recipe, not a silent no-op."""
    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.recipe import resolve as resolve_spec
    from attnkit.wheels.source import apply_patches

    setup = 'nvcc_flags = ["-O3", "-std=c++17"]\ncxx = ["-O3", "-std=c++17"]\nwin = ["/std:c++17"]\n'
    for name in ("flash-attn", "xformers"):
        recipe, path = load_recipe(name)
        for cell, patched in (("torch2.14-cu132-py312", True), ("torch2.13-cu130-py312", False)):
            try:
                spec = resolve_spec(matrix, find_cell(matrix, cell), recipe, path)
            except AttnkitError as exc:  # a shared wheel: build it in the cell that owns it
                spec = resolve_spec(matrix, find_cell(matrix, str(exc).split("built in cell ")[1].split(";")[0]),
                                    recipe, path)
            tree = tmp_path / name / cell
            tree.mkdir(parents=True)
            (tree / "setup.py").write_text(setup)
            apply_patches(spec, tree)
            text = (tree / "setup.py").read_text()
            assert text.count('"-std=c++20"') == (2 if patched else 0), (name, cell, text)
            assert "/std:c++17" in text  # MSVC is exempt from torch's guard: left alone
            if patched:
                (tree / "setup.py").write_text("nothing to patch\n")
                with pytest.raises(AttnkitError, match=rf"recipe {path}: patch of setup.py for torch>=2.14: "
                                                       r"'\"-std=c\+\+17\"' is not there"):
                    apply_patches(spec, tree)
                (tree / "setup.py").unlink()
                with pytest.raises(AttnkitError, match="no such file in the source tree"):
                    apply_patches(spec, tree)


def test_a_bad_patch_specifier_is_one_line(tmp_path, capsys):
    bad = tmp_path / "r.toml"
    bad.write_text('name = "x"\nsource = "matrix"\nextension_modules = ["x"]\n[build]\narch_env = "A"\n'
                   'arch_format = "sm-semicolon"\nmemory_per_job_gib = 1\n[[patches]]\nfile = "setup.py"\n'
                   'torch = "2.14+"\nold = "a"\nnew = "b"\nwhy = "test"\n')
    assert main(["wheels", "env", "--recipe", str(bad), "--cell", "torch2.11-cu130-py312"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: patches.0.torch" in err and "'2.14+' is not a version specifier" in err
    assert len(err.strip().splitlines()) == 1


def test_source_patches_are_part_of_the_source_digest_and_a_local_tree_keeps_its_times(matrix, tmp_path):
    """A patch changes what is compiled, so it is in every object's key (a store filled before a patch changed
    is never linked from); re-preparing a patched local source leaves unchanged files' mtimes alone, so ninja
    recompiles nothing on a re-run."""
    import dataclasses
    import os

    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.recipe import SourcePatch
    from attnkit.wheels.recipe import resolve as resolve_spec
    from attnkit.wheels.source import prepare_source, source_digest

    recipe, path = load_recipe("flash-attn")
    new = find_cell(matrix, "torch2.14-cu132-py312")
    old = find_cell(matrix, "torch2.13-cu130-py312")
    patched, plain = (resolve_spec(matrix, c, recipe, path) for c in (new, old))
    assert source_digest(plain) == plain.sdist_sha256
    assert source_digest(patched).startswith(patched.sdist_sha256 + " patches:")
    other = recipe.model_copy(update={"patches": [pt.model_copy(update={"new": '"-std=c++23"'})
                                                  for pt in recipe.patches]})
    assert source_digest(dataclasses.replace(patched, recipe=other)) != source_digest(patched)

    local = tmp_path / "local"
    local.mkdir()
    (local / "kernel.cu").write_text("// FLAG_A\n")
    (local / "other.cu").write_text("// untouched\n")
    os.utime(local / "kernel.cu", (1_000_000_000, 1_000_000_000))
    patch = SourcePatch(file="kernel.cu", torch=">=2.14", old="FLAG_A", new="FLAG_B", why="test")
    spec = dataclasses.replace(patched, sdist_url=None, sdist_sha256=None, local_source=local,
                               recipe=recipe.model_copy(update={"patches": [patch]}))
    src = prepare_source(spec, tmp_path / "build", tmp_path / "cache")
    assert (src / "kernel.cu").read_text() == "// FLAG_B\n"
    first = (src / "kernel.cu").stat().st_mtime_ns
    assert first != 1_000_000_000 * 10**9  # patched: newer than its source, so ninja compiles it
    prepare_source(spec, tmp_path / "build", tmp_path / "cache")
    assert (src / "kernel.cu").read_text() == "// FLAG_B\n" and (src / "kernel.cu").stat().st_mtime_ns == first
    (local / "kernel.cu").write_text("// FLAG_A changed\n")
    prepare_source(spec, tmp_path / "build", tmp_path / "cache")
    assert (src / "kernel.cu").read_text() == "// FLAG_B changed\n"
    assert source_digest(spec) != source_digest(dataclasses.replace(spec, recipe=recipe.model_copy(
        update={"patches": []})))


def test_a_build_request_is_one_frozen_record_with_one_mode(matrix, tmp_path):
    import dataclasses
    from pathlib import Path

    from attnkit.matrix.expand import find_cell
    from attnkit.wheels.compile import BuildRequest
    from attnkit.wheels.recipe import resolve as resolve_spec

    recipe, path = load_recipe("flash-attn")
    spec = resolve_spec(matrix, find_cell(matrix, "torch2.11-cu130-py312"), recipe, path)
    req = BuildRequest(spec, tmp_path)
    assert req.mode is None and req.python == sys.executable and req.costs == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.jobs = 4  # type: ignore[misc]
    assert BuildRequest(spec, Path("."), plan_only=True).mode == "plan"
    assert BuildRequest(spec, tmp_path, shard=(2, 3), objects=tmp_path).mode == "compile"
    assert BuildRequest(spec, tmp_path, link_only=True, objects=tmp_path).mode == "link"
    with pytest.raises(AttnkitError, match=r"^--shard and --link-only: a job either plans, compiles a shard or links"):
        BuildRequest(spec, tmp_path, shard=(1, 2), link_only=True)


def test_the_cli_carries_every_build_option_into_the_request(monkeypatch, tmp_path):
    from pathlib import Path

    from attnkit.wheels import compile as comp

    got = []

    def fake_build(req):
        got.append(req)
        raise AttnkitError("stop here")

    monkeypatch.setattr(comp, "build_wheel", fake_build)
    rc = main(["wheels", "build", "--cell", "torch2.11-cu130-py312", "--package", "flash-attn", "--out", str(tmp_path),
               "--python", sys.executable, "--jobs", "3", "--no-verify", "--shard", "2/4", "--objects", "store",
               "--costs", "a.json", "--costs", "b.json", "--also-python", "python3.13", "--build-dir", "bd",
               "--toolkit", "pypi"])
    assert rc == 1 and len(got) == 1
    r = got[0]
    assert (r.out, r.python, r.jobs, r.verify, r.shard, r.objects, r.costs, r.also, r.build_dir, r.toolkit) == (
        tmp_path, sys.executable, 3, False, (2, 4), Path("store"), (Path("a.json"), Path("b.json")), ("python3.13",),
        Path("bd"), "pypi")
    assert r.mode == "compile" and r.spec.package == "flash-attn" and r.spec.cell.id == "torch2.11-cu130-py312"


def test_retag_of_a_file_that_is_not_a_zip_is_one_error_and_leaves_nothing(tmp_path):
    """A download cut short, or text saved under a wheel's name (found by a hostile-input sweep, 2026-12-05)."""
    src = tmp_path / "demo_pkg-1.0-cp311-cp311-linux_x86_64.whl"
    src.write_text("not a zip")
    with pytest.raises(AttnkitError, match=f"retag: {src.name}: ") as err:
        retag.retag(src, tmp_path / "out", "demo_pkg-1.0+cu13torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl",
                    "2.11")
    assert "\n" not in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []  # no wheel and no stage left behind
