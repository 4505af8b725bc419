"""The wheel pipeline's pure parts: recipes, arch lists, parallelism, retag, arch/pin checks, index, resolve."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.wheels import build, index, resolve, retag, verify
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
    assert main(["wheels", "env", "--recipe", str(bad), "--cell", "torch2.11-cu130-py312"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: build.arch_format" in err and len(err.strip().splitlines()) == 1
    bad.write_text("name = [")
    assert main(["wheels", "env", "--recipe", str(bad), "--cell", "torch2.11-cu130-py312"]) == 2
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
    jobs, why = build.choose_jobs(cores, mem, threads, per_job)
    assert jobs == expected and f"limited by {limit}" in why
    assert build.choose_jobs(cores, mem, threads, per_job, override=3) == (3, "set by --jobs")
    with pytest.raises(AttnkitError, match="--jobs: must be >= 1"):
        build.choose_jobs(cores, mem, threads, per_job, override=0)


def make_wheel(path: Path, name: str = "demo_pkg", version: str = "1.0", tag: str = "cp311-cp311-linux_x86_64",
               requires: tuple[str, ...] = ("torch", "numpy"), requires_python: str = ">=3.10",
               extra: dict[str, bytes] | None = None) -> Path:
    """A minimal, valid wheel (pure module + dist-info), written by hand like a build backend would."""
    info = f"{name}-{version}.dist-info"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\nRequires-Python: {}\n{}\n".format(
        name.replace("_", "-"), version, requires_python, "".join(f"Requires-Dist: {r}\n" for r in requires))
    files = {f"{name}/__init__.py": b"VALUE = 42\n", f"{info}/METADATA": meta.encode(),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
             **(extra or {})}
    record = []
    for n, data in files.items():
        d = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{n},sha256={d},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = path / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
    return whl


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


def verified(tmp_path: Path, whl: Path, cell: str = "torch2.11-cu130-py311") -> None:
    rep = {"ok": True, "cell": cell, "sha256": hashlib.sha256(whl.read_bytes()).hexdigest(), "problems": []}
    build.verification_path(whl).write_text(json.dumps(rep))


def test_index_is_pep503_with_hashes_and_cell_pages(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    w1 = make_wheel(house, version="1.0+cu13torch2.11cxx11abiTRUE")
    w2 = make_wheel(house, version="1.0+cu13torch2.12cxx11abiTRUE")
    verified(tmp_path, w1)
    verified(tmp_path, w2, "torch2.12-cu130-py311")
    out = tmp_path / "site"
    assert main(["index", "build", str(house), "--out", str(out)]) == 0
    page = (out / "simple" / "demo-pkg" / "index.html").read_text()
    for w in (w1, w2):
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        assert f'href="../../files/{w.name}#sha256={sha}"' in page
        assert (out / "files" / w.name).read_bytes() == w.read_bytes()
    assert 'data-requires-python="&gt;=3.10"' in page
    assert '<a href="demo-pkg/">demo-pkg</a>' in (out / "simple" / "index.html").read_text()
    assert w1.name in (out / "cells" / "torch2.11-cu130-py311.html").read_text()
    assert w2.name not in (out / "cells" / "torch2.11-cu130-py311.html").read_text()
    # base URL: links to release assets, nothing copied
    assert main(["index", "build", str(house), "--out", str(out), "--base-url", "https://x/y/"]) == 0
    assert f'href="https://x/y/{w1.name}#sha256=' in (out / "simple" / "demo-pkg" / "index.html").read_text()
    assert not (out / "files").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["house", "site"]  # no stage dirs left behind


def test_index_refuses_unverified_or_changed_wheels(tmp_path, capsys):
    house = tmp_path / "h"
    house.mkdir()
    w = make_wheel(house, version="1.0+cu13torch2.11cxx11abiTRUE")
    assert main(["index", "build", str(house), "--out", str(tmp_path / "s")]) == 2
    assert "no verification report" in capsys.readouterr().err
    verified(tmp_path, w)
    with zipfile.ZipFile(w, "a") as z:
        z.writestr("extra.txt", "tampered")
    assert main(["index", "build", str(house), "--out", str(tmp_path / "s")]) == 2
    assert "the file changed after verification" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def env(torch="2.11.0+cu130", cuda="13.0", python="3.11"):
    return PyEnv("/x/python", python, "x86_64", torch, cuda, True)


def test_resolve_picks_the_fitting_wheel_and_explains_misses(tmp_path):
    house = tmp_path / "h"
    house.mkdir()
    for v in ("1.0+cu13torch2.11cxx11abiTRUE", "1.1+cu13torch2.11cxx11abiTRUE", "1.1+cu12torch2.11cxx11abiTRUE",
              "1.1+cu13torch2.12cxx11abiTRUE"):
        verified(tmp_path, make_wheel(house, version=v))
    index.build_index(house, tmp_path / "site")
    cands = resolve.listing(str(tmp_path / "site" / "simple"), "demo-pkg")
    assert len(cands) == 4 and all(c.sha256 for c in cands)
    best = resolve.choose(cands, env(), "demo-pkg")
    assert best.filename == "demo_pkg-1.1+cu13torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    assert best.url.startswith("file://") and "#" not in best.url
    with pytest.raises(AttnkitError, match=r"no demo-pkg wheel fits .*\+cu13torch2.13.*nearest: .*torch 2.1[12] vs 2.13"):
        resolve.choose(cands, env(torch="2.13.0+cu130"), "demo-pkg")
    with pytest.raises(AttnkitError, match=r"nearest: .*tags cp311-cp311-linux_x86_64"):
        resolve.choose(cands, env(python="3.12"), "demo-pkg")
    with pytest.raises(AttnkitError, match="CPU build"):
        resolve.choose(cands, env(torch="2.13.0+cpu", cuda=None), "demo-pkg")


def test_install_checks_the_hash(tmp_path):
    house = tmp_path / "h"
    house.mkdir()
    w = make_wheel(house, version="1.0+cu13torch2.11cxx11abiTRUE", requires=())
    verified(tmp_path, w)
    index.build_index(house, tmp_path / "site")
    venv_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
    py = str(venv_dir / "bin" / "python")
    cand = resolve.choose(resolve.listing(str(tmp_path / "site" / "simple"), "demo-pkg"), env(), "demo-pkg")
    installed = tmp_path / "site" / "files" / w.name
    original = installed.read_bytes()
    with zipfile.ZipFile(installed, "a") as z:
        z.writestr("demo_pkg/evil.py", "x = 1")
    with pytest.raises(AttnkitError, match="hash mismatch: the index says sha256"):
        resolve.install(cand, "demo-pkg", python=py)
    installed.write_bytes(original)
    resolve.install(cand, "demo-pkg", python=py)
    r = subprocess.run([py, "-c", "import demo_pkg; print(demo_pkg.VALUE)"], capture_output=True, text=True)
    assert r.stdout.strip() == "42"


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
    verified(tmp_path, make_wheel(house, version="1.0+cu13torch2.11cxx11abiTRUE.sm90"))
    index.build_index(house, tmp_path / "site")
    with pytest.raises(AttnkitError, match="not an attnkit build"):
        resolve.choose(resolve.listing(str(tmp_path / "site" / "simple"), "demo-pkg"), env(), "demo-pkg")


def test_peak_memory_follows_a_growing_machine(monkeypatch):
    """Firecracker VMs grow MemTotal as memory is used: every sample must re-read it, so the peak is real."""
    import threading

    from attnkit.wheels import build as b

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
    assert main(["wheels", "torch", "--cell", "torch2.14-cu999-py312"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cell: unknown cell 'torch2.14-cu999-py312'" in err
