"""What the second hostile sweep found (issue 27's recount, 775 cases on 2026-12-01, stop 33): each case failed
before its fix (a traceback, or a bad input accepted) and must now be ONE line naming the input, or a refusal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_hostile_inputs import run
from wheelkit import make_wheel, verified

from attnkit.errors import AttnkitError
from attnkit.matrix.load import default_matrix_path

torch = pytest.importorskip("torch")

KEY = "cu13torch2.11cxx11abiTRUE"
MATRIX = default_matrix_path().read_text(encoding="utf-8")


def one_line(code: int, err: str, want_code: int, *needles: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == want_code and len(lines) == 1 and lines[0].startswith("attnkit: error: "), (code, err)
    for n in needles:
        assert n in lines[0], lines[0]


def _matrix(tmp_path: Path, old: str, new: str) -> str:
    assert old in MATRIX
    p = tmp_path / "matrix.yaml"
    p.write_text(MATRIX.replace(old, new, 1), encoding="utf-8")
    return str(p)


@pytest.mark.parametrize(("old", "new", "needle"), [
    ("schema_version: 1", "schema_version: " + "9" * 5000, "a value cannot be read"),  # PyYAML: int > 4300 digits
    ('version: "2.8.3.post2"', "version: 2024-02-30", "quote versions and dates"),  # a date that is no date
    ('version: "2.8.3.post2"', 'version: !!int "abc"', "a value cannot be read"),
    ('{sm: "80", min_cuda: "12.3"}', '{sm: "90", min_cuda: "12.3"}', "packages.flash-attn-3.archs[1]"),  # repeated
])
def test_matrix_values_pyyaml_cannot_build_or_repeats(tmp_path, capsys, old, new, needle):
    code, err = run(["matrix", "--file", _matrix(tmp_path, old, new)], capsys)
    one_line(code, err, 1, needle)


def test_a_huge_matrix_file_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (5 * 2**20))
    one_line(*run(["matrix", "--file", str(big)], capsys), 1, "larger than 4 MiB")


@pytest.mark.parametrize(("name", "content", "argv", "code", "needle"), [
    ("r.md", b"\xff\xfe", ["readme", "--readme", "{f}", "--check"], 1, "not UTF-8"),
    ("o.json", b'{"cases": [1]}', ["oracle", "--merge", "{f}"], 2, "cases[0] is not an oracle case"),
    ("o.json", b'{"cases": [{}]}', ["oracle", "--merge", "{f}"], 2, "cases[0] is not an oracle case"),
    ("o.json", b"[" * 100000, ["oracle", "--merge", "{f}"], 2, "not a readable oracle report"),
    ("t.jsonl", b'{"header": true}', ["tune", "--merge", "{f}", "--table", "{d}/t.json"], 2, "header line lacks"),
    ("t.jsonl", b"[" * 100000, ["tune", "--merge", "{f}", "--table", "{d}/t.json"], 2, "no header line"),
    ("t.jsonl", b"\xff\xfe", ["tune", "--merge", "{f}", "--table", "{d}/t.json"], 2, "cannot be read"),
    ("r.toml", b"\xff\xfe", ["wheels", "build", "--recipe", "{f}", "--cell", "torch2.11-cu130-py312"], 1, "UTF-8 TOML"),
    ("fake.whl", b"x", ["wheels", "verify", "{f}", "--cell", "torch2.11-cu130-py312"], 1, "not a wheel file name"),
])
def test_files_that_crashed_a_command(tmp_path, capsys, name, content, argv, code, needle):
    f = tmp_path / name
    f.write_bytes(content)
    one_line(*run([a.format(f=f, d=tmp_path) for a in argv], capsys), code, needle)


def test_a_shard_of_5000_digits_or_other_digits_is_a_usage_error(capsys):
    for shard in ("9" * 5000 + "/" + "9" * 5000, "١/٢"):
        code, err = run(["wheels", "build", "--package", "flash-attn", "--cell", "torch2.11-cu130-py312",
                         "--shard", shard, "--objects", "obj"], capsys)
        one_line(code, err, 2, "--shard")


@pytest.fixture
def house(tmp_path: Path) -> Path:
    h = tmp_path / "proj" / "wheelhouse"
    h.mkdir(parents=True)
    verified(make_wheel(h, version=f"1.0+{KEY}"))
    return h


def test_index_build_refuses_a_linked_out_and_a_non_http_site_url(house, tmp_path, capsys):
    elsewhere = tmp_path / "other_site"
    elsewhere.mkdir()
    (elsewhere / "old.html").write_text("theirs")
    link = tmp_path / "proj" / "link"
    link.symlink_to(elsewhere)
    one_line(*run(["index", "build", str(house), "--out", str(link)], capsys), 2, "symbolic link")
    assert (elsewhere / "old.html").read_text() == "theirs"
    for url in ("javascript:alert(1)//", "file:///etc/", 'https://x/"><script>'):
        one_line(*run(["index", "build", str(house), "--out", str(tmp_path / "site"), "--site-url", url], capsys), 2,
                 "--site-url")
    assert not (tmp_path / "site").exists()


def test_index_build_names_a_deeply_nested_record(house, tmp_path, capsys):
    rec = next(house.glob("*.verify.json"))
    rec.write_text("[" * 100000)
    one_line(*run(["index", "build", str(house), "--out", str(tmp_path / "site")], capsys), 1, rec.name)


def test_wheel_url_skips_links_that_are_no_wheels_and_names_a_bad_index(tmp_path, capsys):
    page = tmp_path / "idx" / "demo-pkg"
    page.mkdir(parents=True)
    (page / "index.html").write_text('<a href="not-a-wheel.whl">x</a> <a href="..%2F..%2Fdemo_pkg-1.0-py3-none-any.whl">'
                                     'y</a> <a href="demo_pkg-1.0-py3-none-any.whl">ok</a>')
    from attnkit.wheels import resolve

    found = resolve.listing(str(tmp_path / "idx"), "demo-pkg", "test")
    assert [c.filename for c in found] == ["demo_pkg-1.0-py3-none-any.whl"]
    for bad in ("http://127.0.0.1:abc/", "http://[::1"):
        code, err = run(["wheel-url", "demo-pkg", "--index", bad], capsys)
        assert code in (1, 2) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("kw", "needle"), [
    ({"softmax_scale": 10**400}, "softmax_scale"),
    ({"softmax_scale": 1e308}, "softmax_scale"),  # finite, and the scores overflow to NaN
    ({"softcap": 1e308}, "softcap"),
    ({"causal": torch.tensor([True, False])}, "causal"),
    ({"attn_bias": torch.zeros(1, 1, 2, 4, 4)}, "attn_bias"),
])
def test_attention_values_that_crashed_or_gave_nan(kw, needle):
    import attnkit

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=needle):
        attnkit.attention(q, q, q, **kw)
    assert math.isfinite(float(attnkit.attention(q, q, q, softmax_scale=1e3).abs().max()))  # large and fine


@pytest.mark.parametrize(("content", "needle"), [
    ({"heads": 10**30, "head_dim": 64, "seqlen": 128}, "heads"),
    ({"heads": 4, "head_dim": 64, "seqlen": 10**30}, "seqlen"),
    ({"heads": 4, "head_dim": 64, "seqlen": 128, "window": [10**30, 0]}, "window"),
    ({"heads": 4, "head_dim": 64, "lengths": [10**30]}, "lengths"),
])
def test_warmup_sizes_beyond_what_attention_accepts(tmp_path, capsys, content, needle):
    f = tmp_path / "shapes.json"
    f.write_text(json.dumps([content]))
    one_line(*run(["warmup", "--shapes", str(f), "--dry-run"], capsys), 1, needle)


@pytest.mark.parametrize(("cfg", "needle"), [
    ({"num_attention_heads": 8, "hidden_size": 10**30}, "hidden_size"),
    ({"num_attention_heads": 8, "hidden_size": 512, "sliding_window": 10**30}, "sliding_window"),
    ({"num_attention_heads": 8, "hidden_size": 512, "sliding_window": 4096, "layer_types": ["evil"]}, "layer_types"),
])
def test_warmup_model_configs_that_were_accepted(tmp_path, capsys, cfg, needle):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    one_line(*run(["warmup", "--model", str(f), "--dry-run"], capsys), 1, needle)


def test_tune_refine_from_a_missing_file(tmp_path, capsys):
    one_line(*run(["tune", "--quick", "--out", str(tmp_path / "n.jsonl"), "--refine", str(tmp_path / "nope.jsonl")],
                  capsys), 2, "--refine")
    assert not (tmp_path / "n.jsonl").exists()


def test_index_build_refuses_a_metadata_zip_bomb(tmp_path, capsys):
    import zipfile

    from attnkit.wheels import retag

    w = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("demo_pkg-1.0.dist-info/METADATA", b"Name: demo\n" + b" " * (retag.MAX_METADATA + 10))
    assert w.stat().st_size < 100_000
    with pytest.raises(AttnkitError, match=r"METADATA is [0-9]+ bytes"):
        retag.metadata_bytes(w)


def test_matrix_bounds_and_options_that_were_ignored(tmp_path, capsys):
    f = _matrix(tmp_path, 'image: "nvidia/cuda:12.6.3-base-ubuntu24.04"', 'image: "' + "u" * 300 + '"')
    code, err = run(["matrix", "--file", f], capsys)
    one_line(code, err, 1, "image")
    one_line(*run(["matrix", "--shards"], capsys), 2, "--shards")


def test_review_leftovers(tmp_path, capsys):
    """Found by the review of the recount's fixes: each was a traceback, a wrong refusal or a wrong acceptance."""
    from attnkit.runtime import warmup

    cfg = tmp_path / "granite.json"  # Granite 4 hybrids: "attention" beside "mamba" layers
    cfg.write_text(json.dumps({"num_attention_heads": 8, "hidden_size": 512, "layer_types": ["mamba", "attention"]}))
    assert [s.window for s in warmup.shapes_from_model(str(cfg), 128, 1, None)] == [None, None, None]
    for field, value in (("grid_cases", "x"), ("backends", [["a"]]), ("backends", 3), ("unavailable", ["x"]),
                         ("seconds", "5")):
        f = tmp_path / "o.json"
        f.write_text(json.dumps({"cases": [], field: value}))
        one_line(*run(["oracle", "--merge", str(f)], capsys), 2, field)
    head = {"header": True, "environment": {"probe": {}}, "grid": {}, "shard": "1/1"}
    row = {"shape": {"label": "x"}, "head_dim": 64, "log2_work": 30.0, "cell": {"fwd": "c"},
           "ms": {"attnkit:a": {"fwd": {"sync": 0, "b2b": 0}}}}
    t = tmp_path / "t.jsonl"
    for bad in ({}, {"log2_work": 1e308}):
        t.write_text(json.dumps(head) + "\n" + json.dumps({**row, **bad}) + "\n")
        code, err = run(["tune", "--merge", str(t), "--table", str(tmp_path / "tab.json")], capsys)
        assert "Traceback" not in err and code in (0, 2), err
    f = tmp_path / "w.json"
    f.write_text(json.dumps([{"heads": 4, "head_dim": 64, "seqlen": 128, "softcap": 1e7}]))
    one_line(*run(["warmup", "--shapes", str(f), "--dry-run"], capsys), 1, "softcap")


def test_third_sweep_outputs_are_checked_before_the_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The sweep of this stop's new surfaces (132 cases): an empty path meant the current folder (`index build
    --out ''` replaced it); an unwritable --out or --claims was found only after the grid had run and its claims
    were used up; a newline in a name split the error in two."""
    from test_hostile_inputs import one_line

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file")
    tests = str(Path(__file__).parent / "fixtures" / "oracle" / "test_flash_attn.py")
    oracle = ["oracle", "--tests", tests, "--backend", "attnkit", "--filter", "dense,mha,d=32,sq=113", "--budget", "30"]
    house = tmp_path / "house"
    house.mkdir()
    verified(make_wheel(house, version="1.0+cu13torch2.11cxx11abiTRUE"))
    cases = [
        (["index", "build", str(house), "--out", ""], 2, "--out: an empty path"),
        ([*oracle, "--out", ""], 2, "--out: an empty path"),
        ([*oracle, "--out", "o.json", "--claims", ""], 2, "--claims: an empty path"),
        (["tune", "--validate", "--out", ""], 2, "--out: an empty path"),
        (["tune", "--rescore", ""], 2, "--rescore: an empty path"),  # said "--out: required" (2026-12-05 sweep)
        (["tune", "--merge", "f", "", "--table", "t.json"], 2, "--merge: an empty path"),  # said ". does not exist"
        (["tune", "--cross-check", ""], 2, "--cross-check: an empty path"),
        ([*oracle, "--out", "o.json", "--resume", ""], 2, "--resume: an empty path"),
        ([*oracle, "--out", "o.json", "--claims", "f/x\ny"], 2, "--claims: 'f/x\\ny': not a folder"),
        ([*oracle, "--out", "o.json", "--claims", "/proc/self"], 2, "--claims: /proc/self"),
        ([*oracle, "--out", "f/x.json", "--claims", "c"], 2, "--out: f/x.json: f is not a writable folder"),
        (["tune", "--validate", "--out", "f/a\nb.json"], 2, "'f/a\\nb.json'"),
        (["bench", "--compiled", "--out", str(house)], 2, "is a folder"),
    ]
    for argv, code, needle in cases:
        got, err = run(argv, capsys)
        assert got == code, (argv, err)
        one_line(err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "house"]  # no claims, reports or sites made
