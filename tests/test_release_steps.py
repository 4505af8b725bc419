"""The release path's commands: release.yml / images.yml and `nox -s release-rehearsal` name the same attnkit
commands with the same options (parsed from the workflow YAML and the rehearsal's step list), and the smoke
gate's names and arguments. No podman or registry needed (the rehearsal itself runs those)."""

from __future__ import annotations

import ast
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from attnkit.images import promote
from attnkit.matrix.expand import find_cell
from attnkit.release import steps

ROOT = Path(__file__).resolve().parents[1]


def workflows() -> dict[str, dict]:
    return {w: yaml.safe_load((ROOT / ".github" / "workflows" / w).read_text()) for w in steps.RELEASE_WORKFLOWS}


def test_workflows_and_rehearsal_name_the_same_commands():
    docs = workflows()
    assert steps.drift(docs) == []
    named = {(wf, job, path) for wf, d in docs.items() for job, cmds in steps.workflow_commands(d).items()
             for path, _ in cmds if path not in steps.PLANNING}
    # the three release commands: the site, the image's wheelhouse, the smoke gate
    assert named == {("release.yml", "publish", ("index", "build")), ("images.yml", "build", ("images", "wheelhouse")),
                     ("images.yml", "smoke-promote", ("images", "promote"))}
    # the options the rehearsal alone passes are few, and each says why
    extra = {s.name: set(s.local_only) for s in steps.STEPS if s.workflow}
    assert extra == {"site": set(), "image-wheelhouse": {"--index"}, "promote": {"--push", "--registry", "--tls-verify"}}
    assert all(len(why) > 20 for s in steps.STEPS for why in s.local_only.values())
    assert all(s.stands_for for s in steps.STEPS if not s.workflow)


@pytest.mark.parametrize("change, expect", [
    (lambda d: d["images.yml"]["jobs"]["smoke-promote"]["steps"][-2].update(
        run="python3 -m pip install -q .\nattnkit images promote --cell \"$CELL\" --tool docker\n"),
     "has options ['--cell', '--tool'], step promote has"),
    (lambda d: d["release.yml"]["jobs"]["publish"]["steps"][3].update(run="attnkit index build wh --out site\n"),
     "`attnkit index build` has options ['--out']"),
    (lambda d: d["images.yml"]["jobs"]["build"]["steps"].append({"run": "attnkit images build --cell x"}),
     "images.yml job build runs `attnkit images build`, which no rehearsal step names"),
    (lambda d: d["images.yml"]["jobs"].pop("smoke-promote"),
     "step promote: images.yml job smoke-promote does not run `attnkit images promote`"),
])
def test_drift_is_caught(change, expect):
    docs = copy.deepcopy(workflows())
    change(docs)
    problems = steps.drift(docs)
    assert any(expect in p for p in problems), problems


def test_invocations_read_continued_lines_pipes_and_paths():
    script = ('python -m pip install -q .\nattnkit index build artifacts/wheelhouse --out site --base-url "x/${TAG}/" \\\n'
              '  --site-url "$(python -c \'print(1)\')"\n/opt/cell/bin/attnkit wheels build --package p --cell=c | tee log\n'
              "attnkit matrix --format json | jq -r .\n")
    assert steps.invocations(script) == [(("index", "build"), {"--out", "--base-url", "--site-url"}),
                                         (("wheels", "build"), {"--package", "--cell"}),
                                         (("matrix",), {"--format"})]


def test_the_rehearsal_runs_every_step():
    tree = ast.parse((ROOT / "src" / "attnkit" / "release" / "rehearsal.py").read_text())
    rendered = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "render"
                and n.args and isinstance(n.args[0], ast.Constant)}
    assert rendered == {s.name for s in steps.STEPS}


def test_render_fills_and_names_a_missing_value():
    argv = steps.render("site", wheelhouse="wh", site="s", base_url="http://h/", site_url="http://h/site")
    assert argv == ["attnkit", "index", "build", "wh", "--out", "s", "--base-url", "http://h/", "--site-url", "http://h/site"]
    with pytest.raises(KeyError, match="step site: no value for site_url"):
        steps.render("site", wheelhouse="wh", site="s", base_url="http://h/")


def test_gate_tags_come_from_naming(matrix):
    cpu = find_cell(matrix, "torch2.13-cpu-py311")
    assert promote.tags_for(matrix, cpu, "runtime", "127.0.0.1:5000/attnkit", None) == (
        "127.0.0.1:5000/attnkit/attnkit:torch2.13-cpu-py311-runtime", ["127.0.0.1:5000/attnkit/attnkit:torch2.13-cpu"])
    ref = find_cell(matrix, "torch2.11-cu130-py312")
    imm, moving = promote.tags_for(matrix, ref, "devel", None, None)
    assert imm == ref.image_tags["devel"][0] and moving == ref.moving_tags["devel"]
    assert "ghcr.io/attnkit/attnkit:latest-devel" in moving
    assert promote.pinned("127.0.0.1:5000/a/b:t1", "sha256:ab") == "127.0.0.1:5000/a/b@sha256:ab"
    with pytest.raises(promote.AttnkitError, match=r"is not in ghcr\.io/attnkit/attnkit"):
        promote.retarget("docker.io/x/y:t", "ghcr.io/attnkit/attnkit", "r/attnkit")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnkit.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, code, needle", [
    (["--cell", "torch2.13-cpu-py311", "--push", "img"], 2, "--push: give exactly one --variant"),
    (["--cell", "torch9.9-cpu-py311", "--variant", "runtime"], 2, "torch9.9-cpu-py311"),
    (["--cell", "torch2.13-cpu-py311", "--tool", "crane"], 2, "--tool"),
    (["--cell", "torch2.13-cpu-py311", "--tls-verify", "no"], 2, "--tls-verify"),
])
def test_promote_bad_input_is_one_line(args, code, needle):
    r = cli("images", "promote", *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith("attnkit: error: ") and needle in lines[0], r.stderr


@pytest.mark.parametrize("ref, parts", [
    ("127.0.0.1:5000/attnkit/attnkit:torch2.13-cpu", ("127.0.0.1:5000", "attnkit/attnkit", "torch2.13-cpu")),
    ("ghcr.io/attnkit/attnkit@sha256:ab12", ("ghcr.io", "attnkit/attnkit", "sha256:ab12")),
    ("ghcr.io/attnkit/attnkit", ("ghcr.io", "attnkit/attnkit", "latest")),
])
def test_registry_reference_parts(ref, parts):
    assert promote._split(ref) == parts


def test_pinned_pull_lines_are_generated_from_the_committed_report():
    import json

    from attnkit.release import docs

    name = "docs/results/2026-12-01-release-rehearsal.json"
    report = json.loads((ROOT / name).read_text())
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert usage == docs.replace_block(usage, docs.pull_block(report, name)), (
        "docs/usage.md's pinned docker pull block is stale: re-run the rehearsal with --docs docs/usage.md")
    digest = report["pushed"]["digests"]["runtime"]
    assert f"@{digest}`" in usage and digest.startswith("sha256:") and len(digest) == 71
    # what the report must show: the gate moved the good image's tags to its digest, and none for the failing one
    assert report["registry"]["tags"]["attnkit/attnkit"] == {"torch2.13-cpu": digest, "torch2.13-cpu-py311-runtime": digest}
    assert list(report["registry"]["tags"]["smokefail/attnkit"]) == ["torch2.13-cpu-py311-runtime"]
    assert report["failing_image"]["moved"] == {} and report["failing_image"]["smoke_exit"] != 0
    assert len(report["checks"]) == 8 and all(report["checks"].values()), report["checks"]
    with pytest.raises(ValueError, match="no generated-block markers"):
        docs.replace_block("no markers here", "x")


def test_the_build_job_pushes_no_moving_tag(matrix):
    """images.yml's bake pushes the targets' tags: only the immutable ones, so a moving tag can only come from the gate."""
    import json

    from attnkit.matrix import emit
    from attnkit.matrix.expand import all_cells

    cells = all_cells(matrix)
    bake = json.loads(emit.to_bake(matrix, cells))
    pushed = {t for target in bake["target"].values() for t in target.get("tags", [])}
    moving = {t for c in cells for ts in c.moving_tags.values() for t in ts}
    assert pushed and moving and not pushed & moving
    assert "ghcr.io/attnkit/attnkit:latest" in moving


@pytest.mark.parametrize("args, needle", [
    ([], "the following arguments are required: --report"),
    (["--report", "/nonexistent-dir/r.json"], "--report /nonexistent-dir/r.json: its folder does not exist"),
    (["--report", "REPORT", "--docs", "/nonexistent.md"], "--docs /nonexistent.md: cannot be read"),
    (["--report", "REPORT", "--docs", "README.md"], "--docs README.md: no generated-block markers"),
])
def test_rehearsal_bad_input_is_one_line_before_any_work(args, needle, tmp_path):
    args = [str(tmp_path / "r.json") if x == "REPORT" else x for x in args]
    r = subprocess.run([sys.executable, "-m", "attnkit.release.rehearsal", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "r.json").exists()


def test_server_and_registry_logs_are_summarised():
    from attnkit.release import rehearsal

    lines = ['127.0.0.1 [01/Dec/2026 11:04:50] "GET /site/k/simple/attnkit-tinyext/ HTTP/1.1" 200 -',
             '127.0.0.1 [01/Dec/2026 11:04:50] "GET /site/k/simple/torch/ HTTP/1.1" 404 -',
             '127.0.0.1 [01/Dec/2026 11:04:50] "GET /site/k/simple/filelock/ HTTP/1.1" 404 -']
    assert rehearsal.served(lines) == {"server_log": lines[:1], "not_on_our_index": ["filelock", "torch"]}
    reg = ('127.0.0.1 - - [01/Dec/2026:11:00:01 +0000] "HEAD /v2/attnkit/attnkit/blobs/sha256:ab HTTP/1.1" 404 157 "" "x"\n'
           '127.0.0.1 - - [01/Dec/2026:11:00:02 +0000] "PUT /v2/attnkit/attnkit/manifests/torch2.13-cpu HTTP/1.1" 201 0\n'
           '127.0.0.1 - - [01/Dec/2026:11:00:03 +0000] "PUT /v2/smokefail/attnkit/manifests/t HTTP/1.1" 201 0\n')
    assert rehearsal.registry_requests(reg) == {"HEAD blobs": 1, "PUT manifests": 2}
    said = "Collecting x\nSuccessfully installed attnkit-tinyext-0.1.0 setuptools-84\n + torch==2.14.1\n + attnkit-tinyext==0.1.0\n"
    assert rehearsal.installed_lines(said) == ["Successfully installed attnkit-tinyext-0.1.0 setuptools-84",
                                               "+ attnkit-tinyext==0.1.0"]


def test_a_failed_smoke_is_explained_by_its_cause_not_the_runner():
    tail = ["nox > /opt/venv/bin/python -m attnkit.cli doctor",
            "nox > Command /opt/venv/bin/python -m attnkit.cli doctor failed with exit code 1",
            "nox > Session smoke failed.", "subprocess exited with status 1", "Error: exit status 1"]
    assert promote._cause(tail) == tail[1]
    assert promote._cause([]) == "no output"
