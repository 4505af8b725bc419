"""`attnkit oracle`: the harness (grid, shards, reference loading, rule, report, merge) on the CPU, with attnkit's
own stand-in reference file; the H200 run with flash-attention's own file is docs/results/2026-12-01-h200-oracle.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attnkit.errors import UsageError  # noqa: E402
from attnkit.runtime import oracle  # noqa: E402
from attnkit.runtime.backends import REGISTRY, Limits  # noqa: E402
from attnkit.runtime.backends.sdpa_math import SdpaMath  # noqa: E402

REF = str(Path(__file__).parent / "fixtures" / "oracle" / "test_flash_attn.py")
ONE = "dense,mha,causal=True,local=False,alibi=False,d=32,sq=113,sk=203"


def test_grid_is_flash_attns_output_grid_plus_softcap() -> None:
    cases = oracle.grid()
    assert len(cases) == 5760 + 288
    assert len({c.tag for c in cases}) == len(cases)
    assert sum(c.softcap > 0 for c in cases) == 288
    # interleaved: the first seventh already holds every layout, dtype, head layout and flag
    first = cases[: len(cases) // 7]
    for attr in ("layout", "dtype", "heads", "causal", "local", "alibi", "d"):
        assert {getattr(c, attr) for c in first} == {getattr(c, attr) for c in cases}, attr


def test_shards_partition_the_grid_by_kernel_configuration() -> None:
    cases = oracle.grid()
    parts = [oracle.select_cases(cases, (i, 3), None) for i in (1, 2, 3)]
    assert sum(map(len, parts)) == len(cases)
    tags = [{c.tag for c in p} for p in parts]
    assert not (tags[0] & tags[1] or tags[1] & tags[2] or tags[0] & tags[2])
    groups = [{c.group for c in p} for p in parts]
    assert not (groups[0] & groups[1] or groups[1] & groups[2])  # no kernel configuration is in two shards


def test_reference_loading_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        oracle.load_reference(str(tmp_path / "nope.py"))
    other = tmp_path / "test_other.py"
    other.write_text("def attention_ref():\n    pass\n")
    with pytest.raises(UsageError, match="defines no construct_local_mask"):
        oracle.load_reference(str(other))
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"\xff\xfe def")
    with pytest.raises(UsageError, match="cannot be read as Python"):
        oracle.load_reference(str(bad))
    checkout = tmp_path / "flash-attention"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "tests" / "test_flash_attn.py").write_text(Path(REF).read_text())
    assert callable(oracle.load_reference(str(checkout))["attention_ref"])  # a checkout works too


def test_cpu_run_passes_and_writes_a_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = oracle.run_oracle(REF, out=str(out), backends=["attnkit", "sdpa_math", "sdpa_flash"], words=ONE.split(","),
                           quiet=True)
    doc = json.loads(out.read_text())
    assert rc == 0
    assert doc["counts"]["attnkit"]["pass"] == doc["counts"]["sdpa_math"]["pass"] == len(doc["cases"]) >= 1
    refused = doc["cases"][0]["results"]["sdpa_flash"]
    assert refused["outcome"] == "refused" and "cuda" in refused["reason"]  # the backend's own reason
    assert doc["cases"][0]["results"]["attnkit"]["selected"]


class _Wrong(SdpaMath):
    """A backend that claims the case and answers 10% off: the oracle must call it wrong, not pass it."""

    name = "wrong_for_test"
    limits = Limits(devices=frozenset({"cpu"}), dtypes=frozenset({"float16"}), gqa="native")

    def bind(self, call: Any, p: Any, q: Any, k: Any, v: Any) -> Any:
        run = super().bind(call, p, q, k, v)
        return lambda q, k, v: run(q, k, v) * 1.1


def test_a_wrong_backend_is_reported_and_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, _Wrong.name, _Wrong())
    out = tmp_path / "r.json"
    rc = oracle.run_oracle(REF, out=str(out), backends=[_Wrong.name, "sdpa_math"], words=ONE.split(","), quiet=True)
    doc = json.loads(out.read_text())
    assert rc == 1
    assert doc["counts"][_Wrong.name]["fail"] == len(doc["cases"]) and doc["counts"]["sdpa_math"]["fail"] == 0
    assert "out" in doc["cases"][0]["results"][_Wrong.name]["over"]


def test_merge_joins_shards_and_recounts(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    oracle.run_oracle(REF, out=str(a), backends=["sdpa_math"], words=[*ONE.split(","), "float16"], quiet=True)
    oracle.run_oracle(REF, out=str(b), backends=["sdpa_math"], words=["dense", "gqa", "causal=False", "local=True", "alibi=True", "d=59", "sq=108"], quiet=True)
    merged = tmp_path / "m.json"
    assert oracle.merge([str(a), str(b), str(a)], str(merged), quiet=True) == 0
    doc = json.loads(merged.read_text())
    n = len(json.loads(a.read_text())["cases"]) + len(json.loads(b.read_text())["cases"])
    assert len(doc["cases"]) == n and doc["counts"]["sdpa_math"]["pass"] == n  # a repeated shard is not counted twice
    (tmp_path / "junk.json").write_text("[]")
    with pytest.raises(UsageError, match=r"junk\.json"):
        oracle.merge([str(tmp_path / "junk.json")], None, quiet=True)


def test_an_own_pick_pass_and_a_forced_pass_merge_per_backend(tmp_path: Path) -> None:
    """The GPU plan: attention()'s own pick over the whole grid, the forced backends over what a budget allows;
    merged, a case holds both passes' results, and 'left by the budget' counts the cases no pass reached."""
    own, forced = tmp_path / "own.json", tmp_path / "forced.json"
    words = ["dense", "mha", "local=False", "alibi=False", "sq=113", "sk=203"]
    oracle.run_oracle(REF, out=str(own), backends=["attnkit"], words=words, quiet=True)
    oracle.run_oracle(REF, out=str(forced), backends=["sdpa_math"], words=[*words, "causal=True", "d=32"], quiet=True)
    merged = tmp_path / "m.json"
    assert oracle.merge([str(own), str(forced)], str(merged), quiet=True) == 0
    doc = json.loads(merged.read_text())
    n = len(json.loads(own.read_text())["cases"])
    assert n >= 2 and len(doc["cases"]) == n and doc["grid_cases"] == n and doc["skipped_budget"] == 0
    assert doc["counts"]["attnkit"]["pass"] == n and doc["counts"]["sdpa_math"]["pass"] == 1
    assert {tuple(p["backends"]) for p in doc["passes"]} == {("attnkit",), ("sdpa_math",)}
    both = [c for c in doc["cases"] if len(c["results"]) == 2]
    assert len(both) == 1 and set(both[0]["results"]) == {"attnkit", "sdpa_math"}
    oracle.run_oracle(REF, out=str(forced), backends=["sdpa_math"], words=words, quiet=True, budget=0.0)
    oracle.merge([str(forced)], str(merged), quiet=True)
    assert json.loads(merged.read_text())["skipped_budget"] == n  # no case reached: all left by the budget


def test_forced_budget_leaves_the_rest_to_the_own_pick(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    oracle.run_oracle(REF, out=str(out), backends=["attnkit", "sdpa_math"],
                      words=["dense", "mha", "local=False", "alibi=False", "sq=113", "sk=203"], quiet=True,
                      forced_budget=0.0)
    doc = json.loads(out.read_text())
    assert doc["own_pick_only"] == len(doc["cases"]) >= 2 and "sdpa_math" not in doc["counts"]
    assert doc["counts"]["attnkit"]["pass"] == len(doc["cases"])


def test_cli_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.cli import main

    for argv, word in ((["oracle"], "--tests"), (["oracle", "--tests", REF, "--shard", "5/4"], "--shard"),
                       (["oracle", "--tests", REF, "--budget", "nan"], "--budget")):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors exit
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert word in err and "Traceback" not in err


def test_cpu_varlen_cases_go_through_the_packed_path(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    words = ["varlen", "gqa", "causal=True", "local=False", "alibi=True", "d=32"]
    assert oracle.run_oracle(REF, out=str(out), backends=["attnkit", "sdpa"], words=words, quiet=True) == 0
    doc = json.loads(out.read_text())
    assert doc["cases"] and doc["counts"]["attnkit"]["pass"] == len(doc["cases"])
    assert all(c["results"]["attnkit"]["selected"] in REGISTRY for c in doc["cases"])


def _own_pick_with(monkeypatch: pytest.MonkeyPatch, name: str, backend: Any, out: Path) -> int:
    """The own-pick pass over ONE with `backend` registered as `name` (the selector's memory cleared around it)."""
    from attnkit.runtime.select import SELECTOR

    monkeypatch.setitem(REGISTRY, name, backend)
    SELECTOR.reset()
    try:
        return oracle.run_oracle(REF, out=str(out), backends=["attnkit"], words=ONE.split(","), quiet=True)
    finally:
        SELECTOR.reset()


def test_an_own_pick_that_falls_back_is_a_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback answers rightly; the oracle still fails the pick that raised (it judges the pick)."""
    picked = oracle.run_oracle(REF, out=str(tmp_path / "a.json"), backends=["attnkit"], words=ONE.split(","),
                               quiet=True)
    assert picked == 0
    name = json.loads((tmp_path / "a.json").read_text())["cases"][0]["results"]["attnkit"]["selected"]

    class Raises(type(REGISTRY[name])):  # type: ignore[misc]
        def bind(self, call: Any, p: Any, q: Any, k: Any, v: Any) -> Any:
            def run(q: Any, k: Any, v: Any) -> Any:
                raise RuntimeError("illegal memory access")
            return run

    rc = _own_pick_with(monkeypatch, name, Raises(), tmp_path / "b.json")
    doc = json.loads((tmp_path / "b.json").read_text())
    assert rc == 1 and doc["counts"]["attnkit"]["fail"] == len(doc["cases"]) >= 1
    assert doc["cases"][0]["results"]["attnkit"]["error"] == f"the pick fell back ({name}: RuntimeError: illegal memory access)"


def test_the_own_pick_is_judged_on_the_forward_alone_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn's grid asks for gradients on every case, so a row for calls without one (inference, such as
    'small windowed forward') would go unchecked: the oracle runs attention()'s pick with no grad as well, judges
    its output under the same rule, and names the backend that served it."""
    assert oracle.run_oracle(REF, out=str(tmp_path / "a.json"), backends=["attnkit"], words=ONE.split(","),
                             quiet=True) == 0
    first = json.loads((tmp_path / "a.json").read_text())["cases"][0]["results"]["attnkit"]
    name = first["selected_forward"]
    assert name in REGISTRY and first["outcome"] == "pass"

    class WrongWithoutGrad(type(REGISTRY[name])):  # type: ignore[misc]
        def bind(self, call: Any, p: Any, q: Any, k: Any, v: Any) -> Any:
            run = super().bind(call, p, q, k, v)
            return run if call.requires_grad else (lambda q, k, v: run(q, k, v) * 1.1)

    rc = _own_pick_with(monkeypatch, name, WrongWithoutGrad(), tmp_path / "b.json")
    res = json.loads((tmp_path / "b.json").read_text())["cases"][0]["results"]["attnkit"]
    assert rc == 1 and res["outcome"] == "fail" and list(res["over"]) == ["out (no grad)"], res
    assert res["selected_forward"] == name


def test_resume_runs_again_an_own_pick_from_before_the_forward_alone_check(tmp_path: Path) -> None:
    """An earlier report's own pick without `selected_forward` never ran the forward alone: --resume runs its
    case again instead of counting it answered; one whose pass with gradients raised stays answered."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    words = ["dense", "mha", "local=False", "alibi=False", "sq=113", "sk=203", "d=32"]
    oracle.run_oracle(REF, out=str(first), backends=["attnkit"], words=words, quiet=True)
    doc = json.loads(first.read_text())
    n = len(doc["cases"])
    assert n >= 2
    for c in doc["cases"]:
        del c["results"]["attnkit"]["selected_forward"]
    doc["cases"][0]["results"]["attnkit"] = {"outcome": "fail", "error": "RuntimeError: x"}
    first.write_text(json.dumps(doc))
    oracle.run_oracle(REF, out=str(second), backends=["attnkit"], words=words, quiet=True, resume=[str(first)])
    ran = json.loads(second.read_text())["cases"]
    assert len(ran) == n - 1 and doc["cases"][0]["case"] not in {c["case"] for c in ran}
    assert all("selected_forward" in c["results"]["attnkit"] for c in ran)


def test_claiming_processes_share_the_grid_and_merge_to_its_whole(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--claims: each kernel configuration runs in exactly one process; merged, the pass covers the selection
    once, beside a sharded pass of the same backend too, and what no process claimed (budget spent) is left."""
    words = ["dense", "mha", "local=False", "alibi=False", "sq=113", "sk=203", "d=32"]
    claims, real = tmp_path / "claims", oracle.claim
    # the first process takes every other configuration it reaches (as if another were faster to the rest)
    met: list[int] = []
    monkeypatch.setattr(oracle, "claim", lambda d, g, w="": bool(met.append(g) or len(met) % 2) and real(d, g, w))
    first_out, second_out = tmp_path / "w1.json", tmp_path / "w2.json"
    oracle.run_oracle(REF, out=str(first_out), backends=["attnkit"], words=words, quiet=True, claims=str(claims))
    monkeypatch.setattr(oracle, "claim", real)
    oracle.run_oracle(REF, out=str(second_out), backends=["attnkit"], words=words, quiet=True, claims=str(claims))
    first, second = (json.loads(r.read_text()) for r in (first_out, second_out))
    a, b = ({c["case"] for c in d["cases"]} for d in (first, second))
    assert a and b and not a & b  # a real split, nothing run twice
    whole = first["pass_grid_cases"]
    assert whole == second["pass_grid_cases"] == len(a | b) and first["worker"] != second["worker"]
    takers = [f.read_text() for f in claims.iterdir()]  # each claim names the process that took it
    assert set(takers) == {first["worker"], second["worker"]}
    merged = tmp_path / "m.json"
    assert oracle.merge([str(first_out), str(second_out)], str(merged), quiet=True) == 0
    doc = json.loads(merged.read_text())
    assert doc["grid_cases"] == whole and doc["skipped_budget"] == 0 and len(doc["cases"]) == whole
    assert not {"claims", "worker", "pass_grid_cases"} & set(doc)  # a merged report is no claiming process
    # a sharded pass of the same backend over the same cases: each case still counts once
    sharded = tmp_path / "s.json"
    oracle.run_oracle(REF, out=str(sharded), backends=["attnkit"], words=words, quiet=True)
    oracle.merge([str(first_out), str(second_out), str(sharded)], str(merged), quiet=True)
    p = json.loads(merged.read_text())["passes"][0]
    assert (p["cases"], p["grid_cases"], p["skipped_budget"]) == (whole, whole, 0)
    # a worker whose budget is spent claims nothing: the pass reports those cases as left
    late = tmp_path / "late.json"
    oracle.run_oracle(REF, out=str(late), backends=["attnkit"], words=words, quiet=True,
                      claims=str(tmp_path / "claims2"), budget=0.0)
    doc = json.loads(late.read_text())
    assert doc["cases"] == [] and doc["grid_cases"] == 0 and not list((tmp_path / "claims2").iterdir())
    oracle.merge([str(late)], str(merged), quiet=True)
    assert json.loads(merged.read_text())["skipped_budget"] == whole
    assert oracle.claim(claims, 10**6, "w") and not oracle.claim(claims, 10**6, "v")  # a group is taken once
    assert (claims / str(10**6)).read_text() == "w"  # and names who took it
    with pytest.raises(UsageError, match="--claims: takes the place of --shard"):
        oracle.run_oracle(REF, backends=["attnkit"], words=words, quiet=True, claims=str(claims), shard=(1, 2))


def test_claimed_work_goes_heaviest_configuration_first() -> None:
    cases = oracle.by_group_heaviest_first(oracle.grid())
    groups = list(dict.fromkeys(c.group for c in cases))
    assert len(groups) == len({c.group for c in cases})  # one configuration after another
    cost = {g: sum(c.sq * c.sk * c.d for c in cases if c.group == g) for g in groups[:1] + groups[-1:]}
    assert cost[groups[0]] >= cost[groups[-1]] and sorted(c.tag for c in cases) == sorted(c.tag for c in oracle.grid())


@pytest.mark.parametrize("tag", ["dense,float16,mqa,causal=False,local=True,alibi=True,d=32,sq=108,sk=256",
                                 "varlen,float16,mqa,causal=False,local=False,alibi=True,d=32,sq=113,sk=203"])
def test_the_cpu_grids_mqa_alibi_gradients_pass(tmp_path: Path, tag: str) -> None:
    """The two cases of the CPU dry-run grid (384 cases) where torch's own CPU kernel missed flash-attn's dk
    tolerance by one float16 ulp: attention() now refuses that kernel there, and its pick passes."""
    out = tmp_path / "r.json"
    rc = oracle.run_oracle(REF, out=str(out), backends=["attnkit", "sdpa"], words=tag.split(","), quiet=True)
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["counts"]["attnkit"]["pass"] == len(doc["cases"]) == 1
    got = doc["cases"][0]["results"]
    assert got["sdpa"]["outcome"] == "refused" and "GQA/MQA with a bias" in got["sdpa"]["reason"]
    assert got["attnkit"]["selected"] == "sdpa_math"


def test_resume_runs_only_what_earlier_reports_left_and_merges_to_the_whole(tmp_path: Path) -> None:
    """--resume: a pass cut by its budget goes on where it stopped. The cases an earlier report answered for every
    backend run now are left out; a backend the report lacks runs them again; merged, the grid is whole once."""
    words = ["dense", "mha", "local=False", "alibi=False", "sq=113", "sk=203", "d=32"]
    first, second, merged = (tmp_path / n for n in ("first.json", "second.json", "merged.json"))
    oracle.run_oracle(REF, out=str(first), backends=["attnkit"], words=words, quiet=True)
    whole = json.loads(first.read_text())["cases"]
    part = {**json.loads(first.read_text()), "cases": whole[: len(whole) // 2]}  # as if the budget ended halfway
    first.write_text(json.dumps(part))
    oracle.run_oracle(REF, out=str(second), backends=["attnkit"], words=words, quiet=True, resume=[str(first)])
    doc = json.loads(second.read_text())
    ran = {c["case"] for c in doc["cases"]}
    assert ran == {c["case"] for c in whole[len(whole) // 2:]} and doc["resumed"]["cases_answered"] == len(part["cases"])
    assert oracle.merge([str(first), str(second)], str(merged), quiet=True) == 0
    m = json.loads(merged.read_text())
    assert len(m["cases"]) == len(whole) and m["skipped_budget"] == 0
    assert m["passes"] == [{"backends": ["attnkit"], "grid_cases": len(whole), "cases": len(whole), "skipped_budget": 0}]
    # a merged report resumed and merged again (stop then go on): its pass stays one pass, not an unnamed part
    third, remerged = tmp_path / "third.json", tmp_path / "remerged.json"
    oracle.merge([str(first)], str(third), quiet=True)
    oracle.merge([str(third), str(second)], str(remerged), quiet=True)
    assert json.loads(remerged.read_text())["passes"] == m["passes"]
    again = tmp_path / "again.json"  # sdpa_math has no outcome in the earlier report: every case runs for it
    oracle.run_oracle(REF, out=str(again), backends=["attnkit", "sdpa_math"], words=words, quiet=True,
                      resume=[str(first)])
    assert len(json.loads(again.read_text())["cases"]) == len(whole)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**part, "tests_sha256": "0" * 64}))
    with pytest.raises(UsageError, match=r"--resume: .*other.json: ran on another tests file"):
        oracle.run_oracle(REF, backends=["attnkit"], words=words, quiet=True, resume=[str(other)])
    other.write_text(json.dumps({**part, "torch": "1.0"}))
    with pytest.raises(UsageError, match=r"--resume: .*other.json: ran on another torch \(1.0; this run"):
        oracle.run_oracle(REF, backends=["attnkit"], words=words, quiet=True, resume=[str(other)])
    (tmp_path / "junk.json").write_text("[1]")
    with pytest.raises(UsageError, match=r"--resume: .*junk.json: not an oracle report"):
        oracle.run_oracle(REF, backends=["attnkit"], words=words, quiet=True, resume=[str(tmp_path / "junk.json")])
