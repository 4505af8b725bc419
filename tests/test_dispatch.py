"""The backend contract and dispatch.py (issue 28): extra_reasons, the lazy registry, bound calls invalidated per
bucket, attnkit.bind(), and every runtime module importing alone (no import cycle)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import attnkit  # noqa: E402
from attnkit.runtime import dispatch  # noqa: E402
from attnkit.runtime.backends import REGISTRY, Backend, Registry  # noqa: E402
from attnkit.runtime.call import Inputs  # noqa: E402
from attnkit.runtime.reference import reference_attention  # noqa: E402
from attnkit.runtime.select import SELECTOR, NoBackendError, explain, priority_for  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_runtime_module_imports_alone_in_a_fresh_process() -> None:
    mods = sorted("attnkit." + ".".join(p.relative_to(SRC / "attnkit").with_suffix("").parts)
                  for p in (SRC / "attnkit" / "runtime").rglob("*.py") if p.name != "__init__.py")
    assert "attnkit.runtime.dispatch" in mods and "attnkit.runtime.loaders" in mods

    def one(mod: str) -> tuple[str, int, str]:
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, check=False)
        return mod, r.returncode, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""

    with ThreadPoolExecutor(2) as pool:
        bad = [r for r in pool.map(one, mods) if r[1] != 0]
    assert not bad, bad


def test_the_probe_imports_no_backend_module() -> None:
    code = ("import sys, attnkit.runtime.probe as p; p.probe(); "
            "print([m for m in sys.modules if m.startswith('attnkit.runtime.backends.')])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def _call(**kw: object) -> object:
    q = torch.randn(1, 8, 2, 16)
    return Inputs(q, q, q, **kw).describe()  # type: ignore[arg-type]


def test_backend_specific_limits_are_extra_reasons() -> None:
    call = _call(causal=True)
    unequal = replace(call, seqlen_q=4)
    assert REGISTRY["sdpa_cpu"].extra_reasons(call, None) == []
    assert REGISTRY["sdpa_cpu"].extra_reasons(unequal, None) == [
        "causal only when seqlen_q == seqlen_k (no bottom-right alignment)"]
    varlen = replace(call, varlen=True, lengths_q=(5, 3), lengths_k=(4, 3))
    assert "at least as many keys as queries" in REGISTRY["xformers"].extra_reasons(varlen, (9, 0))[0]
    assert "cu_seqlens_q == cu_seqlens_k" in REGISTRY["sdpa_cudnn_varlen"].extra_reasons(varlen, (9, 0))[0]
    same = replace(varlen, lengths_k=(5, 3))
    assert REGISTRY["sdpa_cudnn_varlen"].extra_reasons(same, (9, 0)) == []


def test_registry_is_lazy_and_open() -> None:
    reg = Registry({"later": "attnkit_no_such_module:Nope"})
    assert list(reg) == ["later"] and "later" in reg  # listed without importing
    with pytest.raises(ModuleNotFoundError):
        reg["later"]

    class Outside(Backend):
        name = "outside"

    reg.register(Outside())
    assert reg["outside"].name == "outside"
    reg.register("attnkit.runtime.backends.sdpa_math:SdpaMath", "sdpa_math")
    assert reg["sdpa_math"].name == "sdpa_math"
    reg.register("attnkit.runtime.backends.sdpa_math:SdpaMath", "wrong_name")
    with pytest.raises(ValueError, match="is named 'sdpa_math', registered as 'wrong_name'"):
        reg["wrong_name"]
    with pytest.raises(ValueError):
        reg.register("no colon", "x")


def test_no_backend_error_lists_backends_in_priority_order() -> None:
    from attnkit.runtime.probe import probe

    call = _call(causal=True)
    order = priority_for(call, probe())  # type: ignore[arg-type]
    names = list(explain(call, probe()))  # type: ignore[arg-type]
    assert names[: len(order)] == list(order) and sorted(names) == sorted(REGISTRY)
    with pytest.raises(NoBackendError) as exc:
        attnkit.attention(torch.randn(1, 4, 2, 16).to(torch.int8).float(), torch.randn(1, 4, 2, 16),
                          torch.randn(1, 4, 2, 16), backend="sdpa_flash")
    assert "sdpa_flash" in str(exc.value)


def test_a_failure_drops_only_its_bucket() -> None:
    dispatch.invalidate()
    a, b = torch.randn(1, 8, 2, 16), torch.randn(2, 32, 2, 16)
    attnkit.attention(a, a, a, causal=True)
    attnkit.attention(b, b, b)
    assert len(dispatch._DENSE) == 2
    bucket_a = next(x.bucket for x in dispatch.bound_calls() if x.call.seqlen_q == 8)
    SELECTOR.changed(bucket_a)  # what demote() does after a run-time failure in that bucket
    assert [x.call.seqlen_q for x in dispatch.bound_calls()] == [32]
    SELECTOR.changed()
    assert dispatch.bound_calls() == []


def test_bind_runs_the_selected_kernel_on_new_tensors() -> None:
    q = torch.randn(2, 16, 4, 32)
    k = torch.randn(2, 16, 2, 32)
    bound = attnkit.bind(q, k, k, causal=True)
    assert bound.backend.name == attnkit.select(Inputs(q, k, k, causal=True).describe()).name
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    torch.testing.assert_close(bound(q2, k2, k2).double(), reference_attention(q2, k2, k2, causal=True),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bound(q2, k2, k2), attnkit.attention(q2, k2, k2, causal=True))
    assert attnkit.bind(q, k, k, causal=True, backend="sdpa_math").backend.name == "sdpa_math"
    with pytest.raises(ValueError, match="bind\\(\\): unknown option 'casual'"):
        attnkit.bind(q, k, k, casual=True)


def test_cudnn_ragged_works_out_offsets_and_keyless_rows_once_per_bound_call(monkeypatch):
    """The ragged offsets and the rows that see no key depend on cu_seqlens only: bind() makes them, the runner
    is the kernel call and one index_fill (a stand-in kernel here: cuDNN needs an sm90 GPU)."""
    import torch

    from attnkit.runtime.backends import cudnn_ragged as cr
    from attnkit.runtime.call import Inputs

    made = {"meta": 0, "rows": 0}
    real_meta, real_rows = cr._meta, cr.keyless_rows
    monkeypatch.setattr(cr, "_meta", lambda *a: made.__setitem__("meta", made["meta"] + 1) or real_meta(*a))
    monkeypatch.setattr(cr, "keyless_rows", lambda *a: made.__setitem__("rows", made["rows"] + 1) or real_rows(*a))

    class Kernel:
        @staticmethod
        def apply(q, k, v, meta, s):
            return torch.ones(q.shape[0], s.h, s.dv)

    monkeypatch.setattr(cr, "_function", lambda: Kernel)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 0, 4], dtype=torch.int32)
    q, k = torch.randn(7, 2, 8), torch.randn(4, 2, 8)
    call, p = Inputs(q, k, k, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                     max_seqlen_k=4).prepare()
    runner = cr.CudnnRagged().bind(call, p, q, k, k)
    outs = [runner(q, k, k) for _ in range(3)]
    assert made == {"meta": 1, "rows": 1}
    for out in outs:  # sequence 0 has no keys: its 3 rows are zeros; sequence 1 (4 queries, 4 keys) is not
        assert out[:3].abs().sum() == 0 and bool((out[3:] == 1).all())
