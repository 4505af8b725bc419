"""The image pipeline's pure parts: the nvidia/cuda stand-in, the duplicate-library check, the choice of the
cell's wheels for a wheelhouse. The builds themselves: test_images.py (CPU cell, in .ci/run) and
`nox -s images -- --cell ...` (CUDA cells, reports in docs/results)."""

from __future__ import annotations

import pytest
from wheelkit import make_wheel, verified

from attnkit.errors import AttnkitError
from attnkit.images import base, report, wheelhouse
from attnkit.matrix.expand import find_cell


def test_standin_carries_the_nvidia_container_environment(matrix):
    cell = find_cell(matrix, "torch2.11-cu130-py313")
    assert base.suite_for(cell.python) == "trixie" and base.suite_for("3.11") == "bookworm"
    with pytest.raises(AttnkitError, match=r"no Debian release ships Python 3\.12"):
        base.suite_for("3.12")
    release = base.cuda_release(matrix.cuda["13.0"].images.devel.image)
    assert release == "13.0.2"
    devel = base.standin_containerfile("13.0", release, "localhost/debian-base:trixie", toolkit=True)
    for line in ('NVIDIA_VISIBLE_DEVICES="all"', 'NVIDIA_DRIVER_CAPABILITIES="compute,utility"',
                 'NVIDIA_REQUIRE_CUDA="cuda>=13.0"', 'CUDA_VERSION="13.0.2"',
                 'LD_LIBRARY_PATH="/usr/local/nvidia/lib:/usr/local/nvidia/lib64"', "COPY cuda/ /usr/local/cuda/",
                 'org.attnkit.standin-for="nvidia/cuda:13.0.2-devel"'):
        assert line in devel, line
    runtime = base.standin_containerfile("13.0", release, "localhost/debian-base:trixie", toolkit=False)
    assert "COPY cuda/" not in runtime and "/usr/local/cuda/bin" in runtime  # PATH as nvidia/cuda sets it


def test_duplicate_cuda_libraries_are_found():
    paths = ["/opt/venv/lib/python3.13/site-packages/nvidia/cu13/lib/libcudart.so.13",
             "/usr/local/cuda/lib64/libcudart.so.13.0.96", "/usr/local/cuda/lib64/libcudart.so",
             "/opt/venv/lib/python3.13/site-packages/nvidia/cu13/lib/libcublasLt.so.13",
             "/opt/venv/lib/python3.13/site-packages/nvidia/cudnn/lib/libcudnn.so.9", "/usr/lib/libc.so.6"]
    assert report.family(paths[3]) == "libcublasLt.so" and report.family(paths[5]) is None
    assert report.duplicate_cuda_libs(paths) == {
        "libcudart.so": ["/opt/venv/lib/python3.13/site-packages/nvidia/cu13/lib", "/usr/local/cuda/lib64"]}
    assert report.duplicate_cuda_libs(paths[2:]) == {}
    assert report.smoke_counts("...\nsmoke {'passed': 4, 'skipped': 9}\n") == {"passed": 4, "skipped": 9}


def test_wheelhouse_takes_marked_test_builds_only_when_asked(matrix, tmp_path):
    cell = find_cell(matrix, "torch2.11-cu130-py313")
    xf = cell.package("xformers")
    assert xf is not None
    house = tmp_path / "h"
    house.mkdir()
    test_build = verified(make_wheel(house, "xformers", "0.0.35+cu13torch2.11cxx11abiTRUE.sm90",
                                     "py39-none-linux_x86_64"))
    with pytest.raises(AttnkitError, match=r"linux_x86_64.whl \(or an --archs test build, with --test-builds\) is not in --wheels "):
        wheelhouse.cell_wheel(xf, house, test_builds=False)
    assert wheelhouse.cell_wheel(xf, house, test_builds=True) == test_build
    full = verified(make_wheel(house, "xformers", "0.0.35+cu13torch2.11cxx11abiTRUE", "py39-none-linux_x86_64"))
    assert wheelhouse.cell_wheel(xf, house, test_builds=True) == full  # the cell's own wheel wins
    full.with_name(full.name + ".verify.json").unlink()
    with pytest.raises(AttnkitError, match="has no verification report"):
        wheelhouse.cell_wheel(xf, house, test_builds=False)
    with pytest.raises(AttnkitError, match=r"--without: flash-attn-9 is not built for torch2.11-cu130-py313"):
        wheelhouse.build_wheelhouse(cell, tmp_path / "out", house, without=("flash-attn-9",))


def test_labels_follow_what_the_wheelhouse_holds(matrix, tmp_path):
    import json

    from attnkit.images.build import wheelhouse_labels

    cell = find_cell(matrix, "torch2.11-cu130-py313")
    house = tmp_path / "wheelhouse"
    house.mkdir()
    assert wheelhouse_labels(house, cell) == {}  # no manifest: the matrix's versions stand
    (house / "manifest.json").write_text(json.dumps({"cell_wheels": [
        "xformers-0.0.35+cu13torch2.11cxx11abiTRUE.sm90-py39-none-linux_x86_64.whl"], "left_out": ["flash-attn"]}))
    assert wheelhouse_labels(house, cell) == {"FLASH_ATTN_VERSION": "none", "FLASH_ATTN_3_VERSION": "none",
                                              "XFORMERS_VERSION": "0.0.35+cu13torch2.11cxx11abiTRUE.sm90"}


def test_a_failed_podman_step_keeps_its_cause_past_the_step_struct():
    from attnkit.images.build import _explain_failure

    struct = "{Env:[" + " ".join(f"ARG{i}=" + "x" * 40 for i in range(20)) + "] Original:RUN test -n \"${A}\" && {echo; }}"
    out = ("STEP 5/17: RUN pip install\n"
           f"Error: committing container for step {struct}: copying layers and metadata for container \"abc\": "
           "writing blob: io: read/write on closed pipe\n")
    why = _explain_failure(out)
    assert len(why) <= 300
    assert why.startswith("Error: committing container for step {...}")
    assert why.endswith("io: read/write on closed pipe")
    long_cause = "Error: step failed: " + "y" * 400 + " because the disk is full"
    why = _explain_failure(long_cause)
    assert len(why) <= 300 and why.startswith("Error: step failed") and why.endswith("because the disk is full")


def test_a_full_image_store_is_named_with_the_way_out():
    from attnkit.images.build import _explain_failure

    out = ("Error: committing container for step {Env:[A=1]}: copying layers and metadata for container \"x\": "
           "writing blob: storing blob to file \"/var/tmp/storage123/1\": write /var/tmp/storage123/1: "
           "no space left on device\n")
    why = _explain_failure(out, "podman")
    assert why.startswith("no space left on device: podman writes layers to ")
    assert why.endswith("free some with `podman image prune` (dangling images of earlier builds)")
    assert "docker image prune" in _explain_failure(out, "docker")
