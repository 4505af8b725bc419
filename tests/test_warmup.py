"""`attnkit warmup` on CPU: shape files and model configs become the calls to compile for, bad input is one
line naming the file, entry and field, and without a GPU it says so (or lists the plan with --dry-run)."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.runtime import warmup

ROOT_SHAPES = "tools/warmup-shapes.json"


def test_the_example_shape_file_loads():
    shapes = warmup.load_shapes(ROOT_SHAPES)
    assert len(shapes) == 5 and shapes[2].window == (4095, 0) and shapes[3].sizes() == (4096, 4096)
    assert shapes[1].sizes() == (512, 4096) and shapes[1].train is False


@pytest.mark.parametrize(("content", "expect"), [
    ("[", "not JSON"),
    ("{}", "expected a non-empty JSON list of shapes"),
    ('[{"heads": 8}]', "entry 0: head_dim: Field required"),
    ('[{"heads": 8, "head_dim": 64}]', "entry 0: give seqlen, or seqlen_q and seqlen_k, or lengths"),
    ('[{"heads": 8, "kv_heads": 3, "head_dim": 64, "seqlen": 9}]', "heads 8 is not a multiple of kv_heads 3"),
    ('[{"heads": 8, "head_dim": 64, "seqlen": 9, "dtype": "float32"}]', "entry 0: dtype: Input should be"),
    ('[{"heads": 8, "head_dim": 64, "seqlen": 9, "window": [-5, 0]}]', "window (-5, 0): (left, right) ints >= -1"),
    ('[{"heads": 8, "head_dim": 64, "seqlen": 9, "colour": 1}]', "entry 0: colour: Extra inputs are not permitted"),
])
def test_bad_shape_files_fail_in_one_line(tmp_path, capsys, content, expect):
    f = tmp_path / "shapes.json"
    f.write_text(content)
    assert main(["warmup", "--shapes", str(f)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"attnkit: error: --shapes {f}: ") and expect in err and "\n" not in err, err


def test_model_configs_become_train_prefill_and_decode_shapes(tmp_path):
    llama = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    shapes = warmup.shapes_from_model(str(tmp_path), seqlen=2048, batch=4, dtype=None)
    assert [(s.train, s.sizes(), s.head_dim, s.kv_heads, s.window) for s in shapes] == [
        (True, (2048, 2048), 128, 8, None), (False, (2048, 2048), 128, 8, None), (False, (1, 2048), 128, 8, None)]
    mistral = {**llama, "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    assert {s.window for s in warmup.shapes_from_model(str(tmp_path), 8192, 1, "float16")} == {(4095, 0)}
    gemma = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2304,
             "sliding_window": 4096, "attn_logit_softcapping": 50.0,
             "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    g = warmup.shapes_from_model(str(tmp_path / "config.json"), 4096, 1, None)
    assert {s.window for s in g} == {(4095, 0), None} and {s.softcap for s in g} == {50.0} and len(g) == 6
    assert {s.dtype for s in g} == {"bfloat16"}
    bloom = {"model_type": "bloom", "n_head": 32, "n_embed": 4096}  # BLOOM's own key names, ALiBi
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    b = warmup.shapes_from_model(str(tmp_path), 2048, 2, None)
    assert {(s.heads, s.head_dim, s.alibi) for s in b} == {(32, 128, True)} and len(b) == 3
    mpt = {"n_heads": 32, "d_model": 4096, "attn_config": {"alibi": True}}
    (tmp_path / "config.json").write_text(json.dumps(mpt))
    assert {s.alibi for s in warmup.shapes_from_model(str(tmp_path), 2048, 2, None)} == {True}
    assert "alibi" in warmup.WarmupShape(heads=4, head_dim=64, seqlen=128, alibi=True).name()
    assert not any(s.alibi for s in shapes)  # llama
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(AttnkitError, match="needs num_attention_heads and head_dim or hidden_size"):
        warmup.shapes_from_model(str(tmp_path), 4096, 1, None)


def test_dry_run_lists_the_backend_per_shape_and_compiles_nothing(tmp_path, capsys):
    pytest.importorskip("torch")
    rep = tmp_path / "w.json"
    assert main(["warmup", "--shapes", ROOT_SHAPES, "--dry-run", "--report", str(rep)]) == 0
    doc = json.loads(rep.read_text())
    assert doc["dry_run"] is True and len(doc["shapes"]) == 5
    assert all(s["backend"] and s["first_call_s"] is None for s in doc["shapes"])
    assert "dry run: nothing compiled" in capsys.readouterr().out


def test_without_a_gpu_warmup_says_so(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU message does not apply")
    assert main(["warmup", "--shapes", ROOT_SHAPES]) == 1
    assert "no CUDA GPU visible" in capsys.readouterr().err
    assert main(["warmup"]) == 2
    assert "give --shapes FILE.json or --model CONFIG" in capsys.readouterr().err
