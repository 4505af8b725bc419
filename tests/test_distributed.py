"""`attnkit smoke --distributed` on this CPU: real gloo process groups started by torch.distributed.run (2 ranks,
and world size 1), a rank made to give a wrong result, and a rank made to hang, each named in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from attnkit.runtime import distributed

pytest.importorskip("torch")


def smoke(tmp_path, *args, fault=None):
    import os

    env = {**os.environ, "ATTNKIT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(distributed.ENV_FAULT, None)
    if fault:
        env[distributed.ENV_FAULT] = fault
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "smoke", "--distributed", *args], capture_output=True,
                       text=True, env=env, timeout=600, cwd=tmp_path)
    return r, time.monotonic() - t0


def test_bandwidth_is_nccl_tests_definition_and_sizes_go_from_1_kb():
    alg, bus = distributed.bus_bandwidth(1 << 30, 0.01, 8)
    assert alg == pytest.approx(107.374, rel=1e-4) and bus == pytest.approx(alg * 14 / 8)
    assert distributed.bus_bandwidth(1000, 1e-6, 1) == (1.0, 1.0)
    assert distributed.sizes(1 << 30) == [1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26, 1 << 30]


def test_two_gloo_ranks_pass_and_report(tmp_path):
    rep = tmp_path / "dist.json"
    r, _ = smoke(tmp_path, "--nproc", "2", "--report", str(rep))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(rep.read_text())
    assert doc["passed"] and doc["world_size"] == 2 and doc["backend"] == "gloo" and doc["errors"] == []
    assert doc["env"] == distributed.SAFE_ENV
    assert [x["rank"] for x in doc["ranks"]] == [0, 1]
    for rank in doc["ranks"]:
        assert len(rank["collectives"]) == 2 * len(distributed.sizes(distributed.CPU_MAX_BYTES)) * 3
        assert rank["attention"]["outcome"] == "passed" and rank["ddp"]["losses_equal"]
    assert doc["ranks"][0]["ddp"]["loss"] == doc["ranks"][1]["ddp"]["loss"]
    assert doc["bandwidth"] and all(b["busbw_GBps"] > 0 and b["algbw_GBps"] > 0 for b in doc["bandwidth"])
    assert "passed" in r.stdout


def test_world_size_one(tmp_path):
    r, _ = smoke(tmp_path, "--nproc", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 ranks (gloo) passed" in r.stdout


def test_a_wrong_rank_is_named_in_one_line(tmp_path):
    r, _ = smoke(tmp_path, "--nproc", "2", fault="wrong:1:all_reduce")
    assert r.returncode == 1
    failed = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    assert failed and all("all_reduce bfloat16 1024 B: wrong result" in ln for ln in failed), r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_a_hanging_rank_is_ended_by_the_timeout_and_named(tmp_path):
    r, seconds = smoke(tmp_path, "--nproc", "2", "--timeout", "6", fault="hang:1:broadcast")
    assert r.returncode == 1
    assert seconds < 60  # bounded by the timeout, not by the test's
    failed = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    assert any("rank 0 (cpu): broadcast bfloat16 1024 B: did not complete" in ln and "hung" in ln for ln in failed), \
        r.stdout
    assert "Traceback" not in r.stdout + r.stderr
