"""`attnkit smoke` on this machine (CPU in CI): real numerics of every backend that can run here against the
float64 reference, the skip reasons of those that cannot, the report, and that a wrong backend is caught."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="the smoke needs torch (nox -s tests installs it)")

from attnkit.cli import main  # noqa: E402
from attnkit.runtime import smoke  # noqa: E402
from attnkit.runtime.backends import REGISTRY  # noqa: E402


def test_smoke_report_on_this_machine(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    assert main(["smoke", "--report", str(out)]) == 0
    rep = json.loads(out.read_text())
    dev = rep["doctor"]["device"]
    n = len(smoke.CASES) * len(smoke.dtypes(dev))
    assert sum(rep["counts"].values()) == (len(REGISTRY) + 2) * n  # every backend, attention(), compiled
    assert rep["counts"].get("failed", 0) == 0
    by = rep["by_backend"]
    assert by["attnkit"] == {"passed": n}  # attention() itself serves every case here
    assert sum(rep["routes"]["attnkit"].values()) == n  # and bound a runner for each, whose route is recorded
    if dev == "cpu":
        assert by["sdpa_math"] == {"passed": n} and by["sdpa"]["passed"] == n - 1  # all but softcap
        assert by["flash_attn4"] == {"skipped": n}
        # under torch.compile: every dense compiled case (varlen needs a native varlen kernel in a graph)
        assert by[smoke.COMPILED] == {"passed": len(smoke.COMPILED_CASES) - 1, "skipped": n - len(smoke.COMPILED_CASES) + 1}
        assert any(r.startswith("flash_attn4: ") for r in rep["skipped_reasons"])
    alibi = next(c for c in rep["checks"] if c["backend"] == "sdpa_math" and c["case"] == "alibi_cross")
    assert alibi["outcome"] == "passed" and alibi["fwd_err"] < smoke.TOL[alibi["dtype"]][0]
    assert "smoke:" in capsys.readouterr().out


def test_an_interrupted_smoke_reports_the_rows_it_ran_and_does_not_pass(tmp_path, monkeypatch, capsys):
    """A time limit's TERM (the CLI turns it into KeyboardInterrupt) mid-run: the rows done are written, marked
    partial, and the run exits 130. On the GPU machine a limit used to stop every process before it wrote anything."""
    real, calls = smoke.check, []

    def check(backend, case, dtype, device):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append((backend, case, dtype))
        return real(backend, case, dtype, device)

    monkeypatch.setattr(smoke, "check", check)
    out = tmp_path / "smoke.json"
    assert main(["smoke", "--backend", "sdpa_math", "--report", str(out)]) == 130
    rep = json.loads(out.read_text())
    planned = len(smoke.CASES) * len(smoke.dtypes(rep["doctor"]["device"]))
    assert rep["interrupted"] == {"not_run": planned - 3, "planned": planned}
    assert sum(rep["counts"].values()) == 3 and [(c["backend"], c["case"], c["dtype"]) for c in rep["checks"]] == calls
    assert "interrupted: " in capsys.readouterr().out
    monkeypatch.setattr(smoke, "check", real)  # a run that ends has no such key
    assert main(["smoke", "--backend", "sdpa_math", "--case", "mha", "--report", str(out)]) == 0
    assert "interrupted" not in json.loads(out.read_text())


def test_smoke_catches_a_wrong_backend_and_a_crashing_one(monkeypatch):
    from attnkit.runtime.backends.sdpa_math import SdpaMath

    class Wrong(SdpaMath):  # forgets the causal mask
        def bind(self, call, p, q, k, v):
            from dataclasses import replace

            return super().bind(replace(call, causal=False), p, q, k, v)

    class Crashing(SdpaMath):
        def bind(self, call, p, q, k, v):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(REGISTRY, "sdpa_math", Wrong())
    r = smoke.check("sdpa_math", "causal_sq_lt_sk", "float32", "cpu")
    assert r["outcome"] == "failed" and "forward max error" in r["error"]
    assert smoke.check("sdpa_math", "mha", "float32", "cpu")["outcome"] == "passed"
    monkeypatch.setitem(REGISTRY, "sdpa_math", Crashing())
    r = smoke.check("sdpa_math", "mha", "float32", "cpu")
    assert r == {**r, "outcome": "failed", "error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert smoke.run_smoke(backends=["sdpa_math"], cases=["mha"], quiet=True) == 1


def test_a_pick_that_falls_back_fails_its_row_even_when_the_answer_is_right(monkeypatch):
    """attention() retries a backend that raises on the next candidate, so the answer is right; the smoke and the
    oracle judge the pick, and a pick that raised on this machine is a failure they must show."""
    from attnkit.runtime import oracle
    from attnkit.runtime.call import Inputs
    from attnkit.runtime.select import SELECTOR, select

    picked = select(smoke.inputs(smoke.CASES["mha"], "float32", "cpu").describe()).name
    real = REGISTRY[picked]

    class RaisesAtRunTime(type(real)):
        def bind(self, call, p, q, k, v):
            def run(q, k, v):
                raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
            return run

    SELECTOR.reset()
    monkeypatch.setitem(REGISTRY, picked, RaisesAtRunTime())
    try:
        r = smoke.check(smoke.AUTO, "mha", "float32", "cpu")
        assert r["outcome"] == "failed" and r["selected"] == picked, r
        assert r["error"] == (f"the pick fell back ({picked}: RuntimeError: CUDA error: no kernel image is available "
                              "for execution on the device)")
        with SELECTOR.fallbacks() as fell:
            pass
        c, _ = Inputs(*(torch.randn(1, 8, 2, 16) for _ in range(3))).prepare()
        SELECTOR.demote(picked, c, ValueError("x"))  # outside the block: not recorded
        assert fell == []
        assert oracle.AUTO == smoke.AUTO  # the oracle reads the same record (runtime/oracle.py run_case)
    finally:
        SELECTOR.reset()


def test_smoke_arguments_are_checked(capsys):
    assert main(["smoke", "--backend", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error: --backend: unknown backend 'nope'; known: sdpa_cudnn") and "\n" not in err
    assert main(["smoke", "--case", "nope"]) == 2
    assert "--case: unknown case 'nope'; known: mha, gqa" in capsys.readouterr().err


def test_the_smoke_lets_its_flex_signatures_compile_past_dynamos_default_limit():
    """One smoke process makes dozens of flex signatures (block masks included); past dynamo's limit of 8 they ran
    uncompiled on the H100 (2026-12-06), a path no model's process takes: the smoke raises it as bench and tune do."""
    import torch._dynamo.config as cfg

    with cfg.patch(recompile_limit=8, accumulated_recompile_limit=256):  # restored on exit (a monkeypatch of the
        # config module deletes its entries on undo)
        assert smoke.run_smoke(backends=["sdpa_math"], cases=["mha"], quiet=True) == 0
        assert cfg.recompile_limit >= 1024 and cfg.accumulated_recompile_limit >= 8 * 1024


def test_smoke_rows_record_the_route_their_runner_took(monkeypatch):
    """The smoke says how each row reached its kernel (the forced SDPA kernels' direct op or the sdpa_kernel
    context): the route is the function bind() returned, for forced rows and for attention()'s own pick."""
    from attnkit.runtime.backends.sdpa_math import SdpaMath

    r = smoke.check("sdpa_math", "mha", "float32", "cpu")
    assert r["outcome"] == "passed" and r["route"].startswith("SdpaBackend."), r

    class Named(SdpaMath):
        def bind(self, call, p, q, k, v):
            inner = super().bind(call, p, q, k, v)

            def via_named_route(q, k, v):
                return inner(q, k, v)
            return via_named_route

    monkeypatch.setitem(REGISTRY, "sdpa_math", Named())
    r = smoke.check("sdpa_math", "mha", "float32", "cpu")
    assert r["outcome"] == "passed" and r["route"] == "test_smoke_rows_record_the_route_their_runner_took.Named.bind.via_named_route"
    a = smoke.check(smoke.AUTO, "gqa", "float32", "cpu")
    assert a["outcome"] == "passed" and a["route"] and "<locals>" not in a["route"], a
    assert smoke.route(len) == "len"
