"""The benchmark harness on CPU: interleaved timing (order, errors), FLOP counting, the plain-call candidates,
the numerics check that keeps a wrong kernel out of the oracle, and a real quick run of `attnkit bench` whose
report holds every field the runtime issue asks for."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from attnkit.bench import candidates, numerics, run, shapes, timer  # noqa: E402


def test_interleaved_shuffles_predecessors_and_times_blocks():
    seen: list[str] = []
    runs = {n: (lambda n=n: seen.append(n)) for n in "abcde"}
    times = timer.interleaved(runs, "cpu", iters=30)
    assert set(times) == set("abcde") and all(t >= 0 for t in times.values())
    rounds = [seen[i:i + 5] for i in range(0, len(seen), 5)]
    assert len(rounds) == 30 and all(sorted(r) == list("abcde") for r in rounds)
    # a rotation would keep every candidate behind the same predecessor; a shuffle must not
    before_c = {r[r.index("c") - 1] for r in rounds if r.index("c") > 0}
    assert len(before_c) >= 3
    seen.clear()
    timer.interleaved(runs, "cpu", iters=2, calls=7)  # back to back: 7 calls per sample
    assert len(seen) == 2 * 5 * 7


def test_warm_keeps_errors_as_results():
    def broken():
        raise RuntimeError("No execution plans support the graph\nmore detail")

    outs, errors = timer.warm({"ok": lambda: 1, "bad": broken}, "cpu")
    assert outs == {"ok": 1} and errors == {"bad": "RuntimeError: No execution plans support the graph"}


def test_attn_flops_causal_is_half():
    full = shapes.attn_flops(2, 8, 1024, 1024, 128, causal=False)
    assert full == 4 * 2 * 8 * 1024 * 1024 * 128
    assert shapes.attn_flops(2, 8, 1024, 1024, 128, causal=True) == full / 2


@pytest.mark.parametrize("label", [s.label for s in shapes.suite(quick=True)])
def test_plain_candidate_is_correct_and_the_check_catches_a_wrong_output(label):
    """sdpa_plain (the call a user writes: lower-right causal bias, a mask built once, the padded batch for
    varlen) agrees with the reference; a candidate that drops the mask does not pass the check."""
    s = next(s for s in shapes.suite(quick=True) if s.label == label)
    c = candidates.Case(s, "cpu")
    runs, absent = c.candidates(grad=False)
    assert {"sdpa_plain", "attnkit", "attnkit:sdpa_math"} <= set(runs)
    assert absent["flash_attn4"] and absent["attnkit:sdpa_cudnn"]  # with the backends' own reasons
    with torch.no_grad():
        for name in ("sdpa_plain", "attnkit"):
            assert numerics.max_error(c, runs[name](), name) < numerics.BENCH_TOL["float32"], name
        if s.causal and s.seqlen_q > 1:
            from attnkit.runtime.attention import attention

            wrong = attention(c.q, c.k, c.v, **{**c.kw, "causal": False, "window": None})
            assert numerics.max_error(c, wrong, "attnkit") > 10 * numerics.BENCH_TOL["float32"]


@pytest.mark.parametrize("sq, sk", [(32, 96), (96, 32), (64, 64)])
def test_plain_alibi_call_matches_the_reference(sq, sk):
    """The plain call with ALiBi: a bias built once over the mask, also when that mask is torch's
    causal_lower_right object (a Tensor subclass: the H200 sweep's first ALiBi chunk crashed on it)."""
    s = shapes.Shape("alibi", 2, 4, 4, sq, sk, 32, "float32", causal=True, alibi=True, train=False)
    c = candidates.Case(s, "cpu")
    with torch.no_grad():
        assert numerics.max_error(c, c.plain(c.q, c.k, c.v), "sdpa_plain") < numerics.BENCH_TOL["float32"]


def test_ratios_use_the_fastest_correct_candidate():
    ms = {"sdpa_plain": {"fwd": {"sync": 2.0, "b2b": 1.0}}, "attnkit": {"fwd": {"sync": 1.0, "b2b": 1.25}},
          "flash_attn4": {"fwd": {"sync": 0.5, "b2b": 2.0}}}
    r = run.ratios(ms, ["fwd"])["fwd"]
    assert r["sync"] == {"oracle": "flash_attn4", "selected_over_oracle": 0.5, "selected_over_sdpa_plain": 2.0}
    assert r["b2b"] == {"oracle": "sdpa_plain", "selected_over_oracle": 0.8, "selected_over_sdpa_plain": 0.8}


def test_quick_bench_report(tmp_path):
    out = tmp_path / "bench.json"
    assert run.run_bench(str(out), quick=True, png=False) == 0
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["quick"] is True
    assert r["environment"]["probe"]["torch"]["version"] == torch.__version__
    assert [s["label"] for s in r["shapes"]] == [s.label for s in shapes.suite(quick=True)]
    for s in r["shapes"]:
        passes = ["fwd", "fwdbwd"] if s["shape"]["train"] else ["fwd"]
        assert {"label", "call", "selected", "ms", "ratios"} <= set(s)
        assert set(s["ratios"]) == set(passes) and s["selected"] in ("sdpa_cpu", "sdpa")
        for name in ("sdpa_plain", "attnkit", "attnkit:sdpa_math"):
            assert set(s["ms"][name]) == set(passes), (s["label"], name)
            for ps in passes:
                assert set(s["ms"][name][ps]) == {"sync", "b2b"} and s["ms"][name][ps]["sync"] > 0
        assert not s["wrong"], s["wrong"]
        for ps in passes:
            for mode in ("sync", "b2b"):
                ratio = s["ratios"][ps][mode]
                # the oracle is the fastest candidate that was timed and not found wrong, recomputed from the table
                times = {n: t[ps][mode] for n, t in s["ms"].items() if ps in t and n not in s["wrong"]}
                assert ratio["oracle"] == min(times, key=times.__getitem__)
                assert ratio["selected_over_oracle"] == pytest.approx(min(times.values()) / times["attnkit"])
                assert ratio["selected_over_sdpa_plain"] == pytest.approx(times["sdpa_plain"] / times["attnkit"])
    summ = r["summary"]
    assert {"fwd_sync", "fwd_b2b", "fwdbwd_sync", "fwdbwd_b2b", "below_target", "dispatch_overhead_us"} <= set(summ)
    assert summ["fwd_sync"]["shapes"] == len(r["shapes"])
    d = r["dispatch"]
    assert len(d["repeats_us"]) == 3 and d["backend"] == "sdpa_cpu"
    assert d["overhead_us"] == pytest.approx(sorted(d["repeats_us"])[1], abs=1e-3)  # the median repeat
    # the lookup alone (runner swapped for a no-op) costs less than the lookup plus the kernel: no wall-clock bound
    assert 0 < d["wrapper_only_us"] < d["attention_us"]
    assert d["bound_backend"] == d["backend"] and isinstance(d["bound_overhead_us"], float)


def test_bench_resumes_a_report_cut_short_and_refuses_another_machines(tmp_path, capsys):
    """A run stopped by a time limit leaves the shapes it finished; --resume keeps them as they were and times the
    suite's others. A report from another torch, or with a shape the suite no longer has, is one line."""
    from attnkit.cli import main

    out = tmp_path / "bench.json"
    first, second = (s.label for s in shapes.suite(quick=True)[:2])
    assert run.run_bench(str(out), quick=True, png=False, only=[second]) == 0
    earlier = json.loads(out.read_text())
    assert main(["bench", "--quick", "--no-png", "--shape", first, "--shape", second, "--out", str(out),
                 "--resume"]) == 0
    r = json.loads(out.read_text())
    assert [s["label"] for s in r["shapes"]] == [first, second]  # the suite's order, the kept shape among them
    assert r["shapes"][1] == earlier["shapes"][0]  # kept, not timed again
    assert "sync_iters" in r["shapes"][0] and r["shapes"][0]["ms"]
    assert r["environment"]["sessions"] == [earlier["environment"]["date"], r["environment"]["date"]]
    capsys.readouterr()
    for edit, message in ((lambda d: d["environment"]["probe"]["torch"].update(version="0.0"), "measured with torch"),
                          (lambda d: d["shapes"][0].update(label="gone"), "shape 'gone' is not one of"),
                          (lambda d: d["shapes"].append(d["shapes"][0]), "a shape appears twice"),
                          (lambda d: d["shapes"][0].pop("ms"), "not an `attnkit bench --out` report")):
        bad = json.loads(json.dumps(earlier))
        edit(bad)
        out.write_text(json.dumps(bad))
        assert main(["bench", "--quick", "--no-png", "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err
        assert message in err and f"--resume: {out}" in err and "Traceback" not in err, err
        assert json.loads(out.read_text()) == bad  # nothing written over the report
    assert main(["bench", "--quick", "--resume"]) == 2
    assert "--resume: it needs --out" in capsys.readouterr().err
    assert main(["bench", "--compiled", "--out", str(out), "--resume"]) == 2
    assert "--resume: continues the bench suite's report only" in capsys.readouterr().err


def test_sample_counts_follow_the_fastest_candidates_time():
    """Back to back: ~4 ms a sample, at least 20 calls (the first call's host latency is spread over them) up to
    calls of 5 ms, fewer for longer ones (a sample near 100 ms, at least 3 calls), at most 200; with a sync per
    call: more samples for short calls, within [base, 10 x base]."""
    from attnkit.bench.timer import b2b_calls, sync_iters

    assert [b2b_calls(t) for t in (3e-2, 1e-2, 5e-3, 1.5e-3, 1e-4, 1e-5, 0.0)] == [3, 10, 20, 20, 40, 200, 200]
    assert [sync_iters(t, 12) for t in (1.0, 4e-3, 1e-3, 1e-4, 0.0)] == [12, 12, 50, 120, 120]


def test_bench_rejects_an_unknown_shape(capsys):
    from attnkit.cli import main

    assert main(["bench", "--shape", "nope"]) == 2
    assert "--shape: unknown shape 'nope'; known: tiny" in capsys.readouterr().err


def test_compiled_against_eager_side_by_side_on_cpu():
    """bench --compiled's one-shape comparison: the compiled graph computes what eager does, both timed in one
    run (ratios), forward and fwd+bwd; the command itself needs a GPU and says so in one line."""
    from attnkit.bench import compiled
    from attnkit.errors import UsageError

    row = compiled.compare(shapes.Shape("t", 2, 4, 2, 64, 64, 32, "float32"), "cpu", iters=2, rounds=2)
    assert set(row["ratio"]) == {"fwd", "fwdbwd"} and all(x > 0 for m in row["ratio"].values() for x in m.values())
    assert max(row["max_abs_diff"].values()) < 1e-5 and row["eager_pick"]["fwd"]
    # the control in the same race: the plain SDPA call eager and compiled (torch.compile's own cost on the call)
    assert set(row["ratio_plain"]) == {"fwd", "fwdbwd"} and not row.get("control_errors")
    assert all(x > 0 for m in row["ratio_plain"].values() for r in m.values() for x in r.values())
    assert {"plain_eager", "plain_compiled"} <= set(row["ms"]["fwdbwd"])
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="needs a CUDA GPU"):
            compiled.run_compiled("/nonexistent/x.json")


def test_host_added_splits_compiles_cost_between_torch_and_attnkit():
    """From a real compiled run's host totals (the H100 rerun's window-1024 fwd+bwd row): compiling added 769.4 us
    to attnkit's call and 655.6 us to the plain call's; a race without the plain call reports attnkit's alone."""
    from attnkit.bench import compiled

    host = {"eager": {"us_per_call": 803.6}, "compiled": {"us_per_call": 1573.0},
            "plain_eager": {"us_per_call": 638.6}, "plain_compiled": {"us_per_call": 1294.2}}
    assert compiled.host_added(host) == {"attnkit": 769.4, "plain": 655.6}
    del host["plain_compiled"]
    assert compiled.host_added(host) == {"attnkit": 769.4}


def test_host_profile_names_where_a_calls_host_time_goes():
    from attnkit.bench import compiled

    def slow_python():  # own time in a named function, so it must lead the table
        return sum(i * i for i in range(20000))

    prof = compiled.host_profile(slow_python, "cpu", calls=5, top=3)
    assert prof["us_per_call"] > 0 and len(prof["top_own_us"]) == 3
    assert any("slow_python" in name or "genexpr" in name for name in prof["top_own_us"])


def test_replay_counts_say_what_fa4s_replay_did_over_a_candidates_steady_calls(monkeypatch):
    """bench --compiled's diagnosis of a compiled FA4 step's host time: replayed, or FA4's own path every call."""
    from attnkit.bench import compiled
    from attnkit.runtime.backends import fa4_replay

    monkeypatch.setattr(fa4_replay, "STATS", dict.fromkeys(fa4_replay.STATS, 0))

    def own_path_step():  # a step whose forward replays and whose backward runs FA4's own path
        fa4_replay.STATS["replayed"] += 1
        fa4_replay.STATS["own_path"] += 1

    assert compiled.replay_counts(own_path_step, calls=4) == {"replayed": 4, "own_path": 4}
    assert compiled.replay_counts(lambda: None) == {}  # no FA4 in the call: nothing counted


@pytest.mark.parametrize(("name", "jit"), [("attnkit:flash_attn4", True), ("flash_attn4", True), ("attnkit:flex", True),
                                           ("attnkit:sdpa", False), (candidates.PLAIN, False), (candidates.AUTO, False),
                                           ("attnkit:no_such_backend", False)])
def test_compiles_names_the_jit_candidates_by_their_backend(name, jit):
    # the sweep warms these JIT_WARM_CALLS times before pruning (bench/run.py) and compiles only these in its CPU shards (tune.py)
    assert candidates.compiles(name) is jit
