"""attention() and the autotune cache under hostile input (issue 27, items 7 and 10): one ValueError naming the
argument, never a ZeroDivisionError/IndexError/OverflowError/AttributeError; zero keys give zeros; the autotune
table keeps both writers' entries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import attnkit  # noqa: E402

Q = torch.randn(1, 4, 2, 8)
CU4 = torch.tensor([0, 4], dtype=torch.int32)


@pytest.mark.parametrize(("args", "kw", "arg"), [
    ((torch.randn(1, 4, 2, 0),) * 3, {}, "q: head_dim must be >= 1"),
    (([1.0], Q, Q), {}, "q: expected a torch.Tensor"),
    ((Q, [1.0], Q), {}, "k: expected a torch.Tensor"),
    ((Q, Q, Q), {"window": (10**30, 0)}, "window:"),
    ((Q, Q, Q), {"softcap": float("nan")}, "softcap:"),
    ((Q, Q, Q), {"softcap": float("inf")}, "softcap:"),
    ((Q, Q, Q), {"softmax_scale": float("inf")}, "softmax_scale:"),
    ((Q, Q, Q), {"dropout_p": float("nan")}, "dropout_p:"),
    ((torch.randn(4, 2, 8),) * 3, {"cu_seqlens_q": CU4, "cu_seqlens_k": CU4, "max_seqlen_q": 10**12,
                                    "max_seqlen_k": 4}, "max_seqlen_q:"),
])
def test_bad_values_are_one_value_error_naming_the_argument(args: tuple, kw: dict, arg: str) -> None:
    with pytest.raises(ValueError) as exc:
        attnkit.attention(*args, **kw)
    assert str(exc.value).startswith(arg) and "\n" not in str(exc.value)


@pytest.mark.parametrize("causal", [False, True])
def test_zero_keys_give_zeros_and_gradients(causal: bool) -> None:
    q = torch.randn(2, 5, 2, 8, requires_grad=True)
    out = attnkit.attention(q, torch.randn(2, 0, 2, 8), torch.randn(2, 0, 2, 8), causal=causal)
    assert out.shape == q.shape and not out.abs().any()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    cq, ck = torch.tensor([0, 3, 5], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    packed = attnkit.attention(torch.randn(5, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8), causal=causal,
                               cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=3, max_seqlen_k=0)
    assert packed.shape == (5, 2, 8) and not packed.abs().any()


def test_a_loose_max_seqlen_costs_only_the_real_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """30 tokens with max_seqlen 4000: the padded route pads to 30, not 4000 (it used to allocate 4000^2 masks)."""
    from attnkit.runtime import layout

    shapes = []
    real = layout.allowed_mask
    monkeypatch.setattr(layout, "allowed_mask", lambda sq, sk, **kw: shapes.append((sq, sk)) or real(sq, sk, **kw))
    layout.cached_mask.cache_clear()
    cu = torch.tensor([0, 30], dtype=torch.int32)
    t = torch.randn(30, 2, 8)
    out = attnkit.attention(t, t, t, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4000,
                            max_seqlen_k=4000, backend="sdpa_math")
    assert out.shape == t.shape and shapes == [(30, 30)]


def test_an_absurdly_deep_autotune_file_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.runtime.select import _read_cache

    deep = tmp_path / "autotune.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert _read_cache(deep) == {}


_WRITER = r"""
import sys
from attnkit.runtime.select import Selector
who, rounds = sys.argv[1], int(sys.argv[2])
for i in range(rounds):
    s = Selector()
    s._load_disk()
    s.tuned[f"{who}|{i}"] = "sdpa_math"
    s._save_disk()
"""


def test_two_processes_tuning_at_once_keep_both_sides(tmp_path: Path) -> None:
    env = {"ATTNKIT_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, who, "20"], env=env) for who in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    table = json.loads((tmp_path / "autotune.json").read_text())
    assert {f"{w}|{i}" for w in "ab" for i in range(20)} <= set(table)  # 40 entries: no lost update
