"""The benchmark harness on CPU: interleaved timing (order, errors), FLOP counting, and a real quick run of
`attnkit bench` whose report holds every ratio the runtime issue asks for."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from attnkit.runtime import bench  # noqa: E402


def test_interleaved_shuffles_predecessors_and_keeps_errors():
    seen: list[str] = []

    def cand(name: str):
        return lambda: seen.append(name)

    def broken():
        raise RuntimeError("No execution plans support the graph\nmore detail")

    runs = {n: cand(n) for n in "abcde"}
    runs["bad"] = broken
    times, errors = bench.interleaved(runs, "cpu", iters=30, warmup=1)
    assert set(times) == set("abcde") and all(t >= 0 for t in times.values())
    assert errors == {"bad": "RuntimeError: No execution plans support the graph"}
    timed = seen[5:]  # after the warm-up calls, one per candidate
    rounds = [timed[i:i + 5] for i in range(0, len(timed), 5)]
    assert len(rounds) == 30 and all(sorted(r) == list("abcde") for r in rounds)
    # a rotation would keep every candidate behind the same predecessor; a shuffle must not
    before_c = {r[r.index("c") - 1] for r in rounds if r.index("c") > 0}
    assert len(before_c) >= 3


def test_attn_flops_causal_is_half():
    full = bench.attn_flops(2, 8, 1024, 1024, 128, causal=False)
    assert full == 4 * 2 * 8 * 1024 * 1024 * 128
    assert bench.attn_flops(2, 8, 1024, 1024, 128, causal=True) == full / 2


def test_quick_bench_report(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(out), quick=True, png=False) == 0
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["quick"] is True
    assert r["environment"]["probe"]["torch"]["version"] == torch.__version__
    for s in r["shapes"]:
        assert s["selected"] == "sdpa_cpu"
        assert 0.5 < s["selected_over_oracle"] < 2.0, s
        assert "attnkit" in s["results"] and "sdpa_default" in s["results"]
    d = r["dispatch"]
    assert len(d["repeats_us"]) == 3
    assert d["overhead_us"] == pytest.approx(sorted(d["repeats_us"])[1], abs=1e-3)  # the median repeat
    assert d["wrapper_only_us"] > 0
    v = r["varlen"]
    assert "error" not in v, v
    assert 0.2 < v["padding_fraction"] < 0.8
    assert v["packed_backend"] in v["packed_by_backend"]
    assert v["packed_over_padded"] == pytest.approx(v["packed_ms"] / v["padded_ms"])
    assert set(r["summary"]) == {"min_selected_over_oracle", "min_selected_over_sdpa_default",
                                 "dispatch_overhead_us", "dispatch_wrapper_only_us", "varlen_packed_over_padded"}
