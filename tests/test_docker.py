"""docker/: the Dockerfile passes hadolint (errors), and the bake definition and HCL fit together."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from attnkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--failure-threshold", "error", "--no-color", str(path)],
                          capture_output=True, text=True)


def test_hadolint_has_no_errors():
    r = hadolint(ROOT / "docker" / "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_would_catch_an_error(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nWORKDIR relative/dir\nRUN echo hi\n")  # DL3000 is an error
    r = hadolint(bad)
    assert r.returncode != 0 and "error" in r.stdout


def test_bake_targets_inherit_cache_and_attestations(capsys):
    assert main(["matrix", "--format", "bake"]) == 0
    bake = json.loads(capsys.readouterr().out)
    hcl = (ROOT / "docker" / "docker-bake.hcl").read_text()
    assert re.search(r'target "_common"', hcl)
    assert 'attest     = ["type=provenance,mode=max", "type=sbom"]' in hcl
    assert "cache-from" in hcl and "cache-to" in hcl
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\w+)", dockerfile, flags=re.M))
    args = set(re.findall(r"^ARG (\w+)", dockerfile, flags=re.M))
    for name, t in bake["target"].items():
        assert t["inherits"] == ["_common"], name
        assert t["target"] in stages, name
        assert set(t["args"]) <= args, (name, set(t["args"]) - args)  # every bake arg is declared
    assert {"runtime", "devel", "smoke"} <= stages


def test_runtime_stage_has_no_pip_and_runs_as_non_root():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    runtime = dockerfile.split("FROM os AS runtime", 1)[1].split("\nFROM ", 1)[0]
    assert "--without-pip" in dockerfile and "--require-hashes" in dockerfile and "--no-index" in dockerfile
    assert "USER 10001" in runtime and "COPY --from=env /opt/venv /opt/venv" in runtime
    assert "wheelhouse" not in runtime.replace("org.attnkit.wheelhouse", "")  # only ever bind-mounted
