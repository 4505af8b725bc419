"""linux/arm64 as a matrix axis (GH200, GB200): which cells get it, how their wheels are named, built and
indexed, how the CI matrices, the bake file and a multi-platform wheelhouse carry it."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from wheelkit import make_wheel

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.images import wheelhouse
from attnkit.matrix import emit, naming
from attnkit.matrix.expand import all_cells, find_cell

AMD, ARM = "linux/amd64", "linux/arm64"


def _cells(matrix):
    return {c.id: c for c in all_cells(matrix)}


def test_cells_get_arm64_where_pytorch_publishes_aarch64_wheels_with_a_known_arch_list(matrix):
    cells = _cells(matrix)
    # torch 2.8's only aarch64 CUDA build is cu129 (experimental, not built); 12.x arch lists are not known
    assert all(c.platforms == (AMD,) for c in cells.values() if c.torch == "2.8" or (c.cuda or "").startswith("12."))
    assert cells["torch2.11-cu130-py312"].platforms == (AMD, ARM)
    assert cells["torch2.15-cu132-py312"].platforms == (AMD, ARM)
    assert cells["torch2.13-cpu-py311"].platforms == (AMD, ARM)  # CPU wheels exist for both
    both = [c for c in cells.values() if ARM in c.platforms]
    assert len(both) == 41 and all(c.cuda is None or c.cuda.startswith("13.") for c in both)


def test_each_platform_has_its_own_wheels_archs_and_builder(matrix):
    cells = _cells(matrix)
    ref = cells["torch2.11-cu130-py312"]
    for name in ("flash-attn", "xformers", "flash-attn-3"):
        amd, arm = ref.package(name, AMD), ref.package(name, ARM)
        assert amd is not None and arm is not None
        assert amd.wheel.endswith("-linux_x86_64.whl") and arm.wheel.endswith("-linux_aarch64.whl")
        # the platform tag says the machine, the local label (the index key) stays the same
        assert parse_wheel_filename(amd.wheel)[1] == parse_wheel_filename(arm.wheel)[1]
        assert arm.machine == "aarch64" and arm.platform == ARM
    # xformers takes torch's arch list, which differs by machine (PyPI's aarch64 cu130 wheel: sm_80 ... sm_120)
    assert ref.package("xformers", ARM).archs == ("8.0", "9.0", "10.0", "11.0", "12.0")
    assert ref.package("xformers", AMD).archs == tuple(matrix.cuda["13.0"].torch_arch_list)
    assert ref.platform_archs[ARM] == tuple(matrix.cuda["13.0"].torch_arch_list_arm64)
    # every aarch64 wheel is built by a cell published for arm64; a cu126 cell carries no aarch64 wheel
    for c in cells.values():
        for p in c.packages:
            assert p.platform in c.platforms and p.platform in cells[p.built_in].platforms
    assert cells["torch2.11-cu126-py312"].packages_on(ARM) == ()
    # the default view (packages_on, package) is the first platform's, as before the axis existed
    assert [p.platform for p in ref.packages_on()] == [AMD] * 3


def test_github_wheel_jobs_run_natively_on_each_platforms_runner(capsys, matrix):
    assert main(["matrix", "--format", "github", "--package", "flash-attn"]) == 0
    jobs = json.loads(capsys.readouterr().out)["include"]
    pinned = re.compile(r"quay\.io/pypa/manylinux_2_28_(x86_64|aarch64):\d{4}\.\d{2}\.\d{2}-\d+\Z")
    for j in jobs:
        m = pinned.fullmatch(j["container"])
        assert m and m.group(1) == j["machine"] == naming.platform_machine(j["platform"])
        assert j["runner"] == {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}[j["machine"]]
        assert j["wheel"].endswith(f"-linux_{j['machine']}.whl")
    arm = [j for j in jobs if j["machine"] == "aarch64"]
    assert 0 < len(arm) < len(jobs)
    assert main(["matrix", "--format", "github", "--package", "flash-attn", "--platform", ARM]) == 0
    only = json.loads(capsys.readouterr().out)["include"]
    assert sorted(j["wheel"] for j in only) == sorted(j["wheel"] for j in arm)
    # the images matrix: one job per cell, its manifest's platforms as buildx takes them
    assert main(["matrix", "--format", "github", "--torch", "2.11", "--python", "3.12"]) == 0
    by_cell = {e["cell"]: e for e in json.loads(capsys.readouterr().out)["include"]}
    assert by_cell["torch2.11-cu130-py312"]["platforms"] == "linux/amd64,linux/arm64"
    assert by_cell["torch2.11-cu126-py312"]["platforms"] == "linux/amd64"


def test_bake_targets_are_multi_arch_where_the_cell_is(matrix):
    cells = all_cells(matrix)
    targets = json.loads(emit.to_bake(matrix, cells))["target"]
    for c in cells:
        for v in ("runtime", "devel"):
            assert targets[naming.bake_target(c.id, v)]["platforms"] == list(c.platforms)
    assert {tuple(t["platforms"]) for t in targets.values()} == {(AMD,), (AMD, ARM)}


def test_platform_filters_fail_in_one_line(capsys):
    assert main(["matrix", "--platform", ARM, "--torch", "2.8"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such cell is published for linux/arm64" in err
    assert main(["matrix", "--platform", "linux/riscv64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--platform: invalid choice: 'linux/riscv64'" in err


def test_wheelhouse_platforms_default_to_this_machine_and_all_to_the_cells(matrix):
    cells = _cells(matrix)
    here = naming.machine_platform(platform.machine())
    assert wheelhouse.wheelhouse_platforms(cells["torch2.13-cpu-py311"]) == (here,)
    assert wheelhouse.wheelhouse_platforms(cells["torch2.13-cpu-py311"], ("all",)) == (AMD, ARM)
    with pytest.raises(AttnkitError, match=r"--platform: torch2.11-cu126-py312 is not published for linux/arm64"):
        wheelhouse.wheelhouse_platforms(cells["torch2.11-cu126-py312"], (ARM,))
    assert naming.machine_platform("arm64") == ARM  # as Docker and macOS spell it
    with pytest.raises(AttnkitError, match="x86_64, aarch64"):
        naming.machine_platform("ppc64le")


def _lines(text: str) -> dict[str, tuple[Requirement, int]]:
    out = {}
    for line in text.strip().splitlines():
        req, *hashes = line.split(" --hash=")
        r = Requirement(req)
        out[f"{r.name}=={next(iter(r.specifier)).version}"] = (r, len(hashes))
    return out


def _installed_on(lines: dict[str, tuple[Requirement, int]], machine: str) -> set[str]:
    return {k for k, (r, _) in lines.items() if r.marker is None or r.marker.evaluate({"platform_machine": machine})}


def test_multi_platform_requirements_mark_what_one_machine_lacks(tmp_path):
    for m in ("x86_64", "aarch64"):
        make_wheel(tmp_path, "torch", "2.13.0+cpu", f"cp311-cp311-manylinux_2_28_{m}", requires=())
    make_wheel(tmp_path, "nvidia_only", "1.0", "py3-none-manylinux_2_28_x86_64", requires=())  # one closure only
    make_wheel(tmp_path, "pure", "0.8.2", "py3-none-any", requires=())
    make_wheel(tmp_path, "diff", "1.0", "cp311-cp311-manylinux_2_28_x86_64", requires=())  # another version
    make_wheel(tmp_path, "diff", "1.1", "cp311-cp311-manylinux_2_28_aarch64", requires=())  # per machine
    lines = _lines(wheelhouse.requirements_for(tmp_path, ("x86_64", "aarch64")))
    assert lines["torch==2.13.0+cpu"][0].marker is None and lines["torch==2.13.0+cpu"][1] == 2  # both files' hashes
    assert lines["pure==0.8.2"][0].marker is None
    assert _installed_on(lines, "x86_64") == {"torch==2.13.0+cpu", "nvidia-only==1.0", "pure==0.8.2", "diff==1.0"}
    assert _installed_on(lines, "aarch64") == {"torch==2.13.0+cpu", "pure==0.8.2", "diff==1.1"}
    # one machine's wheelhouse: no markers at all (as before the axis)
    assert " ; " not in wheelhouse.requirements_for(tmp_path)
    # the same machine served by two versions is refused in one line
    make_wheel(tmp_path, "diff", "1.2", "py3-none-any", requires=())
    with pytest.raises(AttnkitError, match="wheelhouse: diff has two versions for one machine"):
        wheelhouse.requirements_for(tmp_path, ("x86_64", "aarch64"))


def test_pip_installs_this_machines_files_from_a_multi_platform_wheelhouse(tmp_path):
    """The real pip, the way the Dockerfile runs it (offline, --no-deps, --require-hashes): the marked lines of
    another machine are skipped and every kept line's hash matches this machine's file."""
    house = tmp_path / "house"
    house.mkdir()
    here = platform.machine()
    other = "aarch64" if here == "x86_64" else "x86_64"
    for m in (here, other):
        make_wheel(house, "demo_pkg", "1.0", f"cp{sys.version_info[0]}{sys.version_info[1]}-none-linux_{m}", requires=())
    make_wheel(house, "only_other", "1.0", f"py3-none-linux_{other}", requires=())
    (house / "requirements.txt").write_text(wheelhouse.requirements_for(house, ("x86_64", "aarch64")))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--report", "-", "-q", "--no-index",
                        "--find-links", str(house), "--no-deps", "--require-hashes", "--only-binary=:all:",
                        "--ignore-installed", "-r", str(house / "requirements.txt")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    got = [i["download_info"]["url"].rsplit("/", 1)[1] for i in json.loads(r.stdout)["install"]]
    assert len(got) == 1 and got[0].endswith(f"linux_{here}.whl") and got[0].startswith("demo_pkg-1.0-")


def test_find_cell_still_takes_a_platform_free_id(matrix):
    c = find_cell(matrix, "torch2.11-cu130-py312")
    assert c.id == "torch2.11-cu130-py312" and c.platforms == (AMD, ARM)  # one image tag: a multi-arch manifest


def test_a_foreign_closure_with_machine_markers_is_detected(tmp_path):
    """pip download --platform evaluates Requires-Dist markers for THIS interpreter: a foreign machine's wheel
    that depends on platform_machine is found, so the wheelhouse refuses instead of shipping a wrong closure."""
    make_wheel(tmp_path, "torch", "2.9.1", "cp311-cp311-manylinux_2_28_aarch64",
               requires=('nvidia-nccl-cu12==2.27.5; platform_machine == "x86_64"',))
    make_wheel(tmp_path, "plain", "1.0", "py3-none-any", requires=("numpy",))
    make_wheel(tmp_path, "hostonly", "1.0", "cp311-cp311-manylinux_2_28_x86_64",
               requires=('x; platform_machine == "x86_64"',))
    assert wheelhouse._machine_markers(tmp_path, "aarch64") == ["torch-2.9.1-cp311-cp311-manylinux_2_28_aarch64.whl"]
    assert wheelhouse._machine_markers(tmp_path, "x86_64") == ["hostonly-1.0-cp311-cp311-manylinux_2_28_x86_64.whl"]
