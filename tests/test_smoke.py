"""Smoke tests (`nox -s smoke`): every backend this machine has, forward AND backward, against the float64
reference, for MHA, GQA, causal with seqlen_q != seqlen_k, varlen, sliding window and ALiBi. A backend or
case this machine cannot run is skipped with the backend's own reasons, and the report says so."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no attention backend can run")

from attnkit.runtime.backends import REGISTRY, Params  # noqa: E402
from attnkit.runtime.call import make_call  # noqa: E402
from attnkit.runtime.probe import probe  # noqa: E402
from attnkit.runtime.reference import reference_attention  # noqa: E402

pytestmark = pytest.mark.smoke

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (forward atol, backward atol) per dtype, on unit-variance inputs; errors relative to a float64 reference
TOL = {"float16": (4e-3, 2e-2), "bfloat16": (2.5e-2, 1e-1), "float32": (2e-4, 2e-3), "float64": (1e-7, 1e-6)}

CASES = {
    "mha": dict(sq=64, sk=64, h=4, hkv=4),
    "gqa": dict(sq=64, sk=64, h=8, hkv=2),
    "causal_sq_lt_sk": dict(sq=40, sk=96, h=4, hkv=4, causal=True),
    "causal_sq_gt_sk": dict(sq=96, sk=40, h=4, hkv=2, causal=True),
    "varlen": dict(sq=0, sk=0, h=4, hkv=2, causal=True, varlen=True),
    "varlen_self": dict(sq=0, sk=0, h=4, hkv=2, causal=True, varlen=True, same=True),
    "varlen_self_noncausal": dict(sq=0, sk=0, h=4, hkv=4, varlen=True, same=True),
    "varlen_keyless": dict(sq=0, sk=0, h=4, hkv=2, causal=True, varlen=True, keyless=True),
    "window": dict(sq=80, sk=80, h=4, hkv=4, causal=True, window=(16, 0)),
    "alibi": dict(sq=64, sk=64, h=4, hkv=4, causal=True, alibi=True),
}
DTYPES = ["bfloat16", "float16", "float32"] if DEVICE == "cuda" else ["float32"]


def inputs(case: dict, dtype: str, d: int = 64):
    gen = torch.Generator(device="cpu").manual_seed(0)
    dt = getattr(torch, dtype)

    def r(*s):
        return torch.randn(*s, generator=gen).to(device=DEVICE, dtype=dt).requires_grad_(True)

    kw: dict = {"causal": case.get("causal", False)}
    if case.get("varlen"):
        lq, lk = ([33, 1, 70, 0, 17], [33, 1, 70, 0, 17]) if case.get("same") else ([33, 1, 70, 17], [33, 9, 70, 40])
        if case.get("keyless"):  # rows that see no key: a sequence without keys, more queries than keys
            lq, lk = [20, 5, 30, 7], [8, 0, 30, 12]
        kw["cu_seqlens_q"] = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        kw["cu_seqlens_k"] = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        kw["max_seqlen_q"], kw["max_seqlen_k"] = max(lq), max(lk)
        q, k, v = r(sum(lq), case["h"], d), r(sum(lk), case["hkv"], d), r(sum(lk), case["hkv"], d)
    else:
        q, k, v = r(2, case["sq"], case["h"], d), r(2, case["sk"], case["hkv"], d), r(2, case["sk"], case["hkv"], d)
    if case.get("window"):
        kw["window"] = case["window"]
    if case.get("alibi"):
        kw["alibi_slopes"] = torch.tensor([2 ** (-8 * (i + 1) / case["h"]) for i in range(case["h"])],
                                          device=DEVICE, dtype=torch.float32)
    return q, k, v, kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", list(REGISTRY))
def test_backend_numerics(backend: str, case: str, dtype: str) -> None:
    b = REGISTRY[backend]
    q, k, v, kw = inputs(CASES[case], dtype)
    call = make_call(q, k, v, causal=kw["causal"], dropout_p=0.0, window=kw.get("window"),
                     alibi_slopes=kw.get("alibi_slopes"), attn_bias=None, cu_seqlens_q=kw.get("cu_seqlens_q"),
                     cu_seqlens_k=kw.get("cu_seqlens_k"), max_seqlen_q=kw.get("max_seqlen_q"),
                     max_seqlen_k=kw.get("max_seqlen_k"))
    why = b.check(call, probe())
    if why:
        pytest.skip(f"{backend}: {'; '.join(why)}")
    params = Params(scale=1 / math.sqrt(q.shape[-1]), dropout_p=0.0, window=call.window,
                    alibi_slopes=kw.get("alibi_slopes"), cu_seqlens_q=kw.get("cu_seqlens_q"),
                    cu_seqlens_k=kw.get("cu_seqlens_k"), max_seqlen_q=kw.get("max_seqlen_q"),
                    max_seqlen_k=kw.get("max_seqlen_k"))
    out = b.run(q, k, v, call, params)
    ref_kw = {n: kw[n] for n in ("causal", "window", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k") if n in kw}
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, **ref_kw)
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= fwd_tol, f"forward max error {err:.3g} > {fwd_tol}"
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for name, a, r in zip("qkv", grads, refs, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has NaN/inf"
        e = (a.double() - r).abs().max().item()
        assert e <= bwd_tol, f"d{name} max error {e:.3g} > {bwd_tol}"
