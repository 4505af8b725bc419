"""Hostile inputs (issue 27, items 5, 8 and 9): a malformed matrix.yaml, warmup shape file or model config, or a
bad option value, each ends in ONE line on stderr that names the input, with no traceback: exit 2 for a bad
command line (an option value included), 1 for a bad file. Plus a bounded fuzz over matrix.yaml mutations."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from attnkit.cli import main
from attnkit.matrix.load import default_matrix_path

FIXTURES = Path(__file__).parent / "fixtures" / "matrix"
CELL = "torch2.11-cu130-py312"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The CLI in-process: its exit status and its stderr (argparse's own exits come back as SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def one_line(err: str, *needles: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnkit: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# -- item 5: the matrix loader ----------------------------------------------------------------------------------

HOSTILE_MATRICES = {  # fixture (tests/fixtures/make_matrix_fixtures.py) -> the field or what the line must name
    "alias_bomb": "anchors",
    "alias_only": "aliases",
    "alias_recursive": "anchors",
    "nested_5000": "nested deeper",
    "complex_key": "key must be a plain string",
    "python_unicode_digits": "build.python[0]",
    "python_trailing_newline": "build.python[0]",
    "torch_key_trailing_newline": "torch.'2.8\\n'",
    "release_5000_digits": "torch.2.11.version",
    "sha_trailing_newline": "packages.flash-attn.sdist.sha256",
    "build_python_repeated": "build.python[1]",
    "cuda_stable_repeated": "torch.2.11.cuda.stable[3]",
    "cpu_cell_repeated": "build.cpu[1]",
    "include_repeated": "build.include[1]",
    "schema_version_true": "schema_version",
    "schema_version_float": "schema_version",
    "reference_cell_not_built": "reference_cell",
    "cuda_stable_and_experimental": "torch.2.11.cuda.experimental[0]",
    "registry_newline": "publish.registry",
    "wheel_site_space": "publish.wheel_site",
    "exclude_empty_rule": "build.exclude[0]",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_MATRICES))
def test_hostile_matrix_is_one_line_naming_file_and_field(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = FIXTURES / f"{name}.yaml"
    expect = path.read_text(encoding="utf-8").split("\n", 1)[0].removeprefix("# expect: ")
    t0 = time.perf_counter()
    code, err = run(["matrix", "--file", str(path), "--format", "json"], capsys)
    assert time.perf_counter() - t0 < 5  # the alias bomb took 21 s and 2.2 GB
    assert code == 1, err
    line = one_line(err, str(path), HOSTILE_MATRICES[name], expect)
    assert "allowed" in line or "not" in line or "must" in line or "give" in line  # says what would be accepted


def test_alias_bomb_is_refused_before_it_expands(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Nine levels deep (9**9 strings if expanded): refused at the first anchor, in well under a second."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9 if p else ['lol'] * 9)}]\n"
                            for p, n in zip(["", *"abcdefgh"], "abcdefghi", strict=True)))
    t0 = time.perf_counter()
    code, err = run(["matrix", "--file", str(bomb)], capsys)
    assert time.perf_counter() - t0 < 1.0
    assert code == 1
    one_line(err, f"{bomb}:1:", "anchors (&a) are not allowed")


def test_the_real_matrix_still_loads(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["matrix", "--file", str(default_matrix_path()), "--format", "json"], capsys)
    assert code == 0 and err == ""


# -- item 9: a bad option value is exit 2 everywhere; other errors keep exit 1 -----------------------------------

OPTION_CASES = [
    (["matrix", "--torch", "9.9"], 2, "--torch", "torch 9.9 is not in the matrix"),
    (["matrix", "--cuda", "99.9"], 2, "--cuda", "CUDA 99.9 is not in the matrix"),
    (["matrix", "--package", "nosuch"], 2, "--package", "allowed:"),
    (["matrix", "--python", "３.１２"], 2, "--python", "is not MAJOR.MINOR"),
    (["matrix", "--torch", "2.11\n"], 2, "--torch", "is not MAJOR.MINOR"),
    (["matrix", "--torch", "2." + "1" * 5000], 2, "--torch", "is not MAJOR.MINOR"),
    (["ci-plan", "--torch", "9.9"], 2, "--torch", "torch 9.9 is not in the matrix"),
    (["index", "key", "--torch", "9.9", "--cuda", "13.0"], 2, "--torch", "not in the matrix"),
    (["index", "key", "--torch", "２.１１", "--cuda", "13.0"], 2, "--torch", "is not MAJOR.MINOR"),
    (["wheels", "env", "--cell", CELL, "--package", "flash-attn", "--jobs", "0"], 2, "--jobs", ">= 1"),
    (["wheels", "env", "--cell", CELL, "--package", "flash-attn", "--jobs", "-3"], 2, "--jobs", ">= 1"),
    (["wheels", "build", "--cell", CELL, "--package", "flash-attn", "--jobs", "0"], 2, "--jobs", ">= 1"),
    (["wheels", "plan", "--cell", CELL, "--package", "flash-attn", "--shards", "0"], 2, "--shards", ">= 1"),
    (["wheels", "plan", "--cell", CELL, "--package", "flash-attn", "--shards", "x"], 2, "--shards", ">= 1"),
    (["warmup", "--model", "config.json", "--seqlen", "0"], 2, "--seqlen", ">= 1"),
    (["oracle", "--tests", "9" * 400], 2, "--tests", "File name too long"),  # found by the command-line fuzz
    (["matrix", "--file", "a\nb"], 1, "'a\\nb'", "no such file"),  # a newline in a name: still one line (fuzz)
    (["warmup", "--model", "config.json", "--batch", "-1"], 2, "--batch", ">= 1"),
    # not weakened: a combination of known values that the facts refuse is still a failure, exit 1
    (["matrix", "--torch", "2.8", "--cuda", "13.0"], 1, "--torch/--cuda/--python", "does not ship CUDA 13.0"),
    (["matrix", "--torch", "2.12", "--cuda", "13.2"], 1, "--torch 2.12", "no such cell is built"),
]


@pytest.mark.parametrize(("argv", "code", "option", "expect"), OPTION_CASES,
                         ids=[f"{i}-{' '.join(a[0])[:50]}" for i, a in enumerate(OPTION_CASES)])
def test_bad_option_values_exit_2(argv: list[str], code: int, option: str, expect: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    got, err = run(argv, capsys)
    assert got == code, err
    one_line(err, option, expect)


# -- item 8: warmup shape files and model configs ----------------------------------------------------------------

CONFIG = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
MODEL_CASES: dict[str, tuple[Any, str]] = {  # id -> (config.json content, field the line must name)
    "list": ([CONFIG], "expected a JSON object"),
    "scalar": (7, "expected a JSON object"),
    "heads_0": ({**CONFIG, "num_attention_heads": 0}, "num_attention_heads"),
    "heads_true": ({**CONFIG, "num_attention_heads": True}, "num_attention_heads"),
    "heads_string": ({**CONFIG, "num_attention_heads": "32"}, "num_attention_heads"),
    "heads_float": ({**CONFIG, "num_attention_heads": 32.5}, "num_attention_heads"),
    "kv_not_dividing": ({**CONFIG, "num_key_value_heads": 3}, "num_key_value_heads"),
    "kv_0": ({**CONFIG, "num_key_value_heads": 0}, "num_key_value_heads"),
    "hidden_not_dividing": ({**CONFIG, "hidden_size": 4097}, "hidden_size"),
    "head_dim_negative": ({**CONFIG, "head_dim": -64}, "head_dim"),
    "no_heads": ({"hidden_size": 4096}, "num_attention_heads"),
    "softcap_negative": ({**CONFIG, "attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    "softcap_string": ({**CONFIG, "attn_logit_softcapping": "big"}, "attn_logit_softcapping"),
    "sliding_window_negative": ({**CONFIG, "sliding_window": -5}, "sliding_window"),
    "sliding_window_string": ({**CONFIG, "sliding_window": "4096"}, "sliding_window"),
    "sliding_window_list": ({**CONFIG, "sliding_window": [1, 2]}, "sliding_window"),
    "text_config_null": ({**CONFIG, "text_config": None}, "text_config"),
    "text_config_list": ({**CONFIG, "text_config": [1]}, "text_config"),
    "layer_types_string": ({**CONFIG, "layer_types": "full_attention"}, "layer_types"),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_config_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content, field = MODEL_CASES[case]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(content))
    code, err = run(["warmup", "--model", str(cfg), "--dry-run"], capsys)
    assert code == 1, err
    one_line(err, f"--model {cfg}", field)


SHAPE = {"heads": 8, "head_dim": 64, "seqlen": 128}
SHAPE_CASES: dict[str, tuple[str, str]] = {  # id -> (the file's JSON text, what the line must name)
    "object": (json.dumps(SHAPE), "expected a non-empty JSON list"),
    "empty_list": ("[]", "expected a non-empty JSON list"),
    "list_of_numbers": ("[1]", "entry 0"),
    "list_of_lists": ("[[8, 64]]", "entry 0"),
    "heads_0": (json.dumps([{**SHAPE, "heads": 0}]), "heads"),
    "heads_true": (json.dumps([{**SHAPE, "heads": True}]), "heads"),
    "heads_float": (json.dumps([{**SHAPE, "heads": 8.5}]), "heads"),
    "kv_not_dividing": (json.dumps([{**SHAPE, "heads": 6, "kv_heads": 4}]), "heads 6 is not a multiple of kv_heads 4"),
    "kv_0": (json.dumps([{**SHAPE, "kv_heads": 0}]), "kv_heads"),
    "seqlen_0": (json.dumps([{**SHAPE, "seqlen": 0}]), "seqlen"),
    "batch_negative": (json.dumps([{**SHAPE, "batch": -1}]), "batch"),
    "softcap_negative": (json.dumps([{**SHAPE, "softcap": -1}]), "softcap"),
    "softcap_infinite": ('[{"heads": 8, "head_dim": 64, "seqlen": 128, "softcap": Infinity}]', "softcap"),
    "softcap_nan": ('[{"heads": 8, "head_dim": 64, "seqlen": 128, "softcap": NaN}]', "softcap"),
    "window_string": (json.dumps([{**SHAPE, "window": "ab"}]), "window"),
    "window_negative": (json.dumps([{**SHAPE, "window": [-5, 0]}]), "window"),
    "window_bools": (json.dumps([{**SHAPE, "window": [True, False]}]), "window"),
    "lengths_0": (json.dumps([{**SHAPE, "lengths": [4, 0]}]), "lengths"),
    "causal_string": (json.dumps([{**SHAPE, "causal": "yes"}]), "causal"),
    "no_seqlen": (json.dumps([{"heads": 8, "head_dim": 64}]), "give seqlen"),
    "nested_deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "not_json": ("heads: 8", "not JSON"),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_bad_shape_file_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, needle = SHAPE_CASES[case]
    path = tmp_path / "shapes.json"
    path.write_text(text)
    code, err = run(["warmup", "--shapes", str(path), "--dry-run"], capsys)
    assert code == 1, err
    one_line(err, f"--shapes {path}", needle)


# -- a bounded fuzz over matrix.yaml mutations --------------------------------------------------------------------

_TOKENS = ["", "null", "true", "1.0", "-1", "[]", "{}", "[{}]", "&a x", "*a", "? [a, b]", '"3.１０"', '"3.10\\n"',
           '"2.' + "1" * 5000 + '"', "[" * 200, "!!python/object:os.system", "~", "'", '"', ":", "- x", "\t", "\x00",
           "é", "12.6", '"13.0"', "{torch: \"2.11\"}", "0x1F", ".inf", "!!binary aGk=", "2026-01-01"]


def _mutate(text: str, rng: random.Random, n: int) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(n):
        i = rng.randrange(len(lines))
        op = rng.randrange(5)
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(rng.randrange(len(lines)), lines[i])  # a repeated entry
        elif op == 2 and ":" in lines[i]:  # a value replaced
            key = lines[i].split(":", 1)[0]
            lines[i] = f"{key}: {rng.choice(_TOKENS)}\n"
        elif op == 3:  # a token inside a line
            j = rng.randrange(len(lines[i]) + 1)
            lines[i] = lines[i][:j] + rng.choice(_TOKENS) + lines[i][j:]
        else:  # a quoted version changed
            lines[i] = lines[i].replace('"', rng.choice(['"3.', '"1', '"', "'", '"\\n']), 1)
        if not lines:
            lines = ["x: 1\n"]
    return "".join(lines)


def test_fuzz_matrix_mutations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Random mutations of the real matrix.yaml (bounded: 20 s): every run exits 0, 1 or 2, with at most one line
    on stderr, never a traceback or an exception out of main(); a refusal names the file. Uses hypothesis when
    installed (it shrinks a failure to the smallest mutation), else a seeded random walk of the same mutations."""
    base = default_matrix_path().read_text(encoding="utf-8")
    path = tmp_path / "matrix.yaml"
    deadline = time.monotonic() + 20

    def check(seed: int, n: int) -> None:
        text = _mutate(base, random.Random(seed), n)
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        try:
            code = main(["matrix", "--file", str(path), "--format", "json"])
        except BaseException as exc:  # SystemExit included: main() turns every error into a code
            raise AssertionError(f"seed {seed} n {n}: {type(exc).__name__}: {exc}") from exc
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (seed, n, code)
        assert "Traceback" not in err
        assert len(err.strip().splitlines()) <= 1, (seed, n, err)
        if code:
            assert str(path) in err, (seed, n, err)

    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError:
        rng = random.Random(27)
        for _ in range(400):
            if time.monotonic() > deadline:
                break
            check(rng.randrange(2**32), rng.randrange(1, 6))
        return

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.integers(0, 2**32 - 1), st.integers(1, 5))
    def fuzz(seed: int, n: int) -> None:
        if time.monotonic() < deadline:
            check(seed, n)

    fuzz()


# -- a fuzz over command lines ------------------------------------------------------------------------------------

# subcommands whose hostile calls stay on this machine and cheap: no network, no build, nothing written outside
# the test's folder (every path value points into it or nowhere)
FUZZ_COMMANDS = (("matrix",), ("ci-plan",), ("index", "key"), ("warmup",), ("tune",), ("oracle",), ("smoke",),
                 ("bench",), ("wheels", "env"), ("wheels", "torch"), ("index", "build"))
_VALUES = ["", "-1", "0", "1", "9" * 400, "nan", "inf", "1e309", "3/2", "0/0", "a/b", "2.99", "３.１２", "é",
           "--", "-", "x" * 300, "torch2.11-cu130-py312", "flash-attn", "nosuch", "2.11", "13.0", "3.12",
           "{DIR}/nope.json", "{DIR}", "/proc/attnkit/x", "{DIR}/" + "n" * 300, "\n", " ", "\\", "*", "%s%n"]


def _options(argv_prefix: tuple[str, ...]) -> list[str]:
    """The option strings argparse knows for a subcommand (read from the parser itself)."""
    import argparse

    from attnkit.cli import build_parser

    parser = build_parser()
    for word in argv_prefix:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return sorted(s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help"))


def test_fuzz_command_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Random hostile command lines of the cheap subcommands (bounded: 25 s): every run ends in exit 0, 1, 2 (or
    argparse's 2), never an exception out of main() and never a traceback; a failure is one line; nothing is
    written outside the test's folder. hypothesis shrinks a failure; without it, a seeded random walk."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNKIT_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.chdir(tmp_path)
    opts = {c: _options(c) for c in FUZZ_COMMANDS}
    deadline = time.monotonic() + 25
    checkout = Path(__file__).resolve().parents[1]
    before = {p: p.stat().st_mtime_ns for p in (checkout / "docs").rglob("*")}
    codes: list[int] = []

    def check(seed: int) -> None:
        rng = random.Random(seed)
        cmd = rng.choice(FUZZ_COMMANDS)
        argv = [*cmd]
        for _ in range(rng.randrange(0, 4)):
            argv.append(rng.choice(opts[cmd]))
            if rng.random() < 0.85:
                argv.append(rng.choice(_VALUES).replace("{DIR}", str(tmp_path)))
        if cmd == ("smoke",) and "--case" not in argv:
            argv += ["--case", "nosuch"]  # a real smoke run is another test's job
        if cmd == ("bench",) and "--shape" not in argv:
            argv += ["--shape", "nosuch"]
        if cmd == ("tune",) and not {"--plan", "--merge", "--validate"} & set(argv):
            argv += ["--merge", str(tmp_path / "none.jsonl")]
        if cmd == ("warmup",):
            argv.append("--dry-run")
        if cmd == ("index", "build"):
            argv[2:2] = [str(tmp_path / "wheels-in"), "--out", str(tmp_path / "site")]
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own exits: usage errors (2), --help (0)
            code = int(exc.code or 0)
        except BaseException as exc:
            raise AssertionError(f"{argv!r}: {type(exc).__name__}: {exc}") from exc
        err = capsys.readouterr().err
        codes.append(code)
        assert code in (0, 1, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code:
            lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage:", "  "))]
            assert len(lines) == 1, (argv, err)

    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError:
        rng = random.Random(28)
        while time.monotonic() < deadline:
            check(rng.randrange(2**32))
    else:
        @settings(max_examples=250, deadline=None, database=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(st.integers(0, 2**32 - 1))
        def fuzz(seed: int) -> None:
            if time.monotonic() < deadline:
                check(seed)

        fuzz()
    after = {p: p.stat().st_mtime_ns for p in (checkout / "docs").rglob("*")}
    assert after == before  # nothing in the checkout was written
    assert len(codes) >= 40 and {1, 2} <= set(codes), (len(codes), sorted(set(codes)))  # it did exercise refusals
