"""Shared fixtures, and the smoke report: `pytest -m smoke --smoke-report PATH` writes every smoke test's
outcome (and skip reason) with the doctor report, so a machine's check is one JSON file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--smoke-report", default=None, help="write a JSON report of smoke tests here")


_RESULTS: list[dict[str, Any]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "smoke" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry: dict[str, Any] = {"test": report.nodeid.split("::", 1)[-1], "outcome": report.outcome,
                                 "seconds": round(report.duration, 4)}
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            entry["error"] = str(report.longrepr).splitlines()[-1][:500] if report.longrepr else ""
        _RESULTS.append(entry)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = session.config.getoption("--smoke-report")
    if not out:
        return
    from attnkit._io import write_atomic
    from attnkit.runtime.doctor import report

    counts: dict[str, int] = {}
    for r in _RESULTS:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    skipped_why: dict[str, int] = {}
    for r in _RESULTS:
        if r["outcome"] == "skipped":
            skipped_why[r.get("reason", "?")] = skipped_why.get(r.get("reason", "?"), 0) + 1
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "counts": counts,
           "skipped_reasons": skipped_why, "doctor": report(), "tests": _RESULTS, "exitstatus": int(exitstatus)}
    write_atomic(out, json.dumps(doc, indent=1, default=str))


@pytest.fixture(scope="session")
def matrix():
    from attnkit.matrix import load_matrix

    return load_matrix(ROOT / "matrix.yaml")
