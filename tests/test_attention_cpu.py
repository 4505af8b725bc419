"""Real numerics on CPU: attention() (SDPA cpu/math) against the float64 reference, forward and backward,
for every semantic: MHA, GQA, bottom-right causal with seqlen_q != seqlen_k, varlen, windows, ALiBi, bias."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the runtime tests need torch (nox -s tests installs it)")

import attnkit  # noqa: E402
from attnkit.runtime.reference import reference_attention  # noqa: E402


def rand(*shape, grad=True):
    return torch.randn(*shape, dtype=torch.float32, requires_grad=grad)


def check(q, k, v, backend=None, **kw):
    out = attnkit.attention(q, k, v, backend=backend, **kw)
    ref = reference_attention(q.detach(), k.detach(), v.detach(), **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    # backward against autograd through the float64 reference
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    r = reference_attention(q64, k64, v64, **kw)
    rq, rk, rv = torch.autograd.grad(r, (q64, k64, v64), g.double())
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)
    return out


CASES = {
    "mha": dict(),
    "causal": dict(causal=True),
    "scale": dict(softmax_scale=0.3),
    "window_causal": dict(causal=True, window=(3, 0)),
    "window_both": dict(window=(2, 1)),
    "window_left_only": dict(window=(2, -1)),
    "alibi": dict(causal=True, alibi_slopes="heads"),
    "alibi_batch": dict(alibi_slopes="batch_heads"),
    "bias": dict(attn_bias="full"),
    "softcap": dict(causal=True, softcap=1.5),
}


# sdpa (torch's own pick) has no softcap argument: sdpa_math writes that math out
@pytest.mark.parametrize(("case", "backend"), [(c, b) for c in CASES for b in (None, "sdpa", "sdpa_math")
                                               if not (c == "softcap" and b == "sdpa")])
@pytest.mark.parametrize(("sq", "sk", "hkv"), [(9, 9, 4), (5, 11, 2), (11, 5, 1)])
def test_matches_reference(case, sq, sk, hkv, backend):
    torch.manual_seed(0)
    b, h, d = 2, 4, 16
    kw = dict(CASES[case])
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.rand(h)
    elif kw.get("alibi_slopes") == "batch_heads":
        kw["alibi_slopes"] = torch.rand(b, h)
    if kw.get("attn_bias") == "full":
        kw["attn_bias"] = torch.randn(1, h, sq, sk)
    check(rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d), backend=backend, **kw)


def test_rows_without_keys_are_zero_not_nan():
    torch.manual_seed(1)
    q, k, v = rand(1, 6, 2, 8), rand(1, 3, 2, 8), rand(1, 3, 2, 8)
    out = check(q, k, v, causal=True)  # bottom-right: the first 3 queries see nothing
    assert torch.all(out[:, :3] == 0)
    assert torch.all(out[:, 3:].abs().sum(-1) > 0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_reference_and_padded(causal):
    torch.manual_seed(2)
    lq, lk, h, hkv, d = [5, 1, 7, 0], [5, 3, 9, 2], 4, 2, 16
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = rand(sum(lq), h, d), rand(sum(lk), hkv, d), rand(sum(lk), hkv, d)
    check(q, k, v, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    # each packed sequence equals attention on that sequence alone
    out = attnkit.attention(q, k, v, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=7,
                            max_seqlen_k=9)
    for i in range(len(lq)):
        if lq[i] == 0 or lk[i] == 0:
            continue
        alone = attnkit.attention(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
                                  causal=causal)[0]
        torch.testing.assert_close(out[cq[i]:cq[i + 1]], alone, atol=1e-5, rtol=1e-5)


def test_pack_unpack_roundtrip():
    torch.manual_seed(3)
    x = torch.randn(3, 6, 2, 4)
    lengths = torch.tensor([6, 2, 0])
    packed, idx, cu, mx = attnkit.pack(x, lengths)
    assert packed.shape == (8, 2, 4) and cu.dtype == torch.int32 and cu.tolist() == [0, 6, 8, 8] and mx == 6
    back = attnkit.unpack(packed, idx, 3, 6)
    assert torch.equal(back[0], x[0]) and torch.equal(back[1, :2], x[1, :2])
    assert torch.all(back[1, 2:] == 0) and torch.all(back[2] == 0)
    mask = torch.tensor([[True, False, True, False, False, False]] * 3)
    p2, _, cu2, _ = attnkit.pack(x, mask)
    assert p2.shape[0] == 6 and cu2.tolist() == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="keep: lengths must be within"):
        attnkit.pack(x, torch.tensor([7, 0, 0]))


def test_gqa_is_not_materialised_for_native_backends(monkeypatch):
    """sdpa_math declares native GQA: k/v must reach SDPA with kv_heads, via enable_gqa."""
    import torch.nn.functional as F

    seen = {}
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen["k_heads"], seen["gqa"] = k.shape[1], kw.get("enable_gqa")
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 4, 2, 16)
    attnkit.attention(q, k, k, backend="sdpa_math")
    assert seen == {"k_heads": 2, "gqa": True}


BAD = [
    (lambda q, k, v: dict(q=q[0]), "q: expected 4 dims"),
    (lambda q, k, v: dict(k=k.double()), "k: dtype float64 differs from q's float32"),
    (lambda q, k, v: dict(q=q.int(), k=k.int(), v=v.int()), "q: dtype int32 is not supported"),
    (lambda q, k, v: dict(k=torch.randn(2, 5, 4, 8)), "k: head_dim 8 differs from q's 16"),
    (lambda q, k, v: dict(k=torch.randn(2, 5, 3, 16), v=torch.randn(2, 5, 3, 16)),
     "k: q has 4 heads, which is not a multiple of k's 3 heads"),
    (lambda q, k, v: dict(v=torch.randn(2, 6, 2, 16)), "v: shape (2, 6, 2, 16) does not match k's"),
    (lambda q, k, v: dict(dropout_p=1.5), "dropout_p: must be in [0, 1)"),
    (lambda q, k, v: dict(window=(3,)), "window: expected (left, right)"),
    (lambda q, k, v: dict(alibi_slopes=torch.rand(3)), "alibi_slopes: shape (3,) is not (4,)"),
    (lambda q, k, v: dict(attn_bias=torch.randn(1, 4, 7, 7)), "attn_bias: shape (1, 4, 7, 7) does not broadcast"),
    (lambda q, k, v: dict(backend="nope"), "backend: unknown backend 'nope'"),
    (lambda q, k, v: dict(softmax_scale=-1.0), "softmax_scale: expected a positive number"),
    (lambda q, k, v: dict(softcap=-1.0), "softcap: expected a number from 0 (off)"),
    (lambda q, k, v: dict(window=(3, -2)), "window: expected (left, right) ints >= -1"),
    (lambda q, k, v: dict(q=q.reshape(-1, 4, 16), k=k.reshape(-1, 2, 16), v=v.reshape(-1, 2, 16),
                          cu_seqlens_q=torch.tensor([0, 5, 6]), cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32),
                          max_seqlen_q=5, max_seqlen_k=5), "cu_seqlens_q: expected a 1-D int32 tensor"),
    (lambda q, k, v: dict(q=q.reshape(-1, 4, 16), k=k.reshape(-1, 2, 16), v=v.reshape(-1, 2, 16),
                          cu_seqlens_q=torch.tensor([0, 7, 6], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32),
                          max_seqlen_q=7, max_seqlen_k=5), "cu_seqlens_q: must be non-decreasing"),
    (lambda q, k, v: dict(q=q.reshape(-1, 4, 16), k=k.reshape(-1, 2, 16), v=v.reshape(-1, 2, 16),
                          cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32),
                          max_seqlen_q=5, max_seqlen_k=5), "cu_seqlens_q: ends at 9 but the packed tensor has 10"),
    (lambda q, k, v: dict(q=q.reshape(-1, 4, 16), k=k.reshape(-1, 2, 16), v=v.reshape(-1, 2, 16),
                          cu_seqlens_q=torch.tensor([0, 5, 10], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32),
                          max_seqlen_q=4, max_seqlen_k=5), "max_seqlen_q: 4 is smaller than the longest"),
]


@pytest.mark.parametrize(("make", "expect"), BAD, ids=[e for _, e in BAD])
def test_bad_input_raises_valueerror_naming_the_argument(make, expect):
    q, k, v = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
    args = dict(q=q, k=k, v=v)
    args.update(make(q, k, v))
    with pytest.raises(ValueError) as ei:
        attnkit.attention(**args)
    assert expect in str(ei.value)


def test_fast_path_reuses_decision():
    from attnkit.runtime.dispatch import _DENSE as _FAST

    _FAST.clear()
    q = torch.randn(1, 8, 2, 16)
    a = attnkit.attention(q, q, q, causal=True)
    assert len(_FAST) == 1
    b = attnkit.attention(q, q, q, causal=True)
    torch.testing.assert_close(a, b)
    assert len(_FAST) == 1


def test_cached_call_is_the_plain_sdpa_call_with_no_context_manager(monkeypatch):
    """No sdpa_kernel context and no flag flips on the hot path: torch's own pick on CPU is its flash kernel,
    so sdpa_cpu calls F.scaled_dot_product_attention exactly as a user would."""
    import torch.nn.attention as tna
    import torch.nn.functional as F

    from attnkit.runtime.dispatch import _DENSE as _FAST

    _FAST.clear()
    seen: list[dict] = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    monkeypatch.setattr(tna, "sdpa_kernel", lambda *a, **kw: pytest.fail("context manager on the hot path"))
    q = torch.randn(2, 16, 4, 32)
    k = torch.randn(2, 16, 2, 32)
    for _ in range(3):
        out = attnkit.attention(q, k, k, causal=True)
    assert seen == [{"enable_gqa": True, "is_causal": True}] * 3
    assert next(iter(_FAST.values())).backend.name == "sdpa_cpu"
    torch.testing.assert_close(out.double(), reference_attention(q, k, k, causal=True), atol=1e-5, rtol=1e-5)


def test_forced_kernel_pays_the_context_only_when_torch_would_pick_another(monkeypatch):
    """sdpa_math is never torch's own pick for a fused-able call: it is forced through sdpa_kernel; sdpa_cpu
    (torch's pick on CPU) is not."""
    import torch.nn.attention as tna

    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.call import Inputs

    entered: list = []
    real = tna.sdpa_kernel

    def spy(*a, **kw):
        entered.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(tna, "sdpa_kernel", spy)
    q = torch.randn(1, 8, 2, 16)
    call, params = Inputs(q, q, q, causal=True).prepare()
    REGISTRY["sdpa_cpu"].bind(call, params, q, q, q)(q, q, q)
    assert entered == []
    REGISTRY["sdpa_math"].bind(call, params, q, q, q)(q, q, q)
    assert len(entered) == 1


@pytest.mark.parametrize("eligible", [True, False])
def test_forced_kernel_calls_its_op_directly_where_torchs_eligibility_check_passes(monkeypatch, eligible):
    """sdpa_cudnn forced where torch would pick flash: with torch's own check for cuDNN passing, the runner is
    the cuDNN op called directly (no sdpa_kernel context); with it failing, the context stays."""
    import torch.backends.cuda as tbc
    import torch.nn.attention as tna
    from torch.nn.attention import SDPBackend

    from attnkit.runtime.backends import REGISTRY, _sdpa
    from attnkit.runtime.call import Inputs

    checked: list = []
    monkeypatch.setattr(tbc, "can_use_cudnn_attention", lambda params, debug: checked.append(params) or eligible)
    backend = REGISTRY["sdpa_cudnn"]
    monkeypatch.setattr(type(backend), "_torch_pick", lambda *a: int(SDPBackend.FLASH_ATTENTION))

    def direct_op(q, k, v):
        return q

    asked: list = []
    monkeypatch.setattr(_sdpa, "_direct", lambda picked, *a: asked.append(picked) or direct_op)
    entered: list = []
    real = tna.sdpa_kernel
    monkeypatch.setattr(tna, "sdpa_kernel", lambda *a, **kw: entered.append(a[0]) or real(*a, **kw))
    q = torch.randn(1, 8, 2, 16)
    call, params = Inputs(q, q, q, causal=True).prepare()
    runner = backend.bind(call, params, q, q, q)
    assert len(checked) == 1  # torch's SDPAParams took this torch's arguments: the check really ran
    assert (runner is direct_op) is eligible
    assert asked == ([int(SDPBackend.CUDNN_ATTENTION)] if eligible else [])
    if not eligible:  # the context's runner (it cannot run cuDNN on a CPU: the context is seen entered)
        with pytest.raises(RuntimeError):
            runner(q, q, q)
        assert runner.__name__ == "forced" and entered == [[SDPBackend.CUDNN_ATTENTION]]


def test_forced_kernel_with_a_mask_keeps_the_context(monkeypatch):
    """A window's mask is not what the direct ops take: the eligibility check is not even asked."""
    import torch.backends.cuda as tbc
    from torch.nn.attention import SDPBackend

    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.call import Inputs

    monkeypatch.setattr(tbc, "can_use_cudnn_attention", lambda *a: pytest.fail("asked with a mask"))
    backend = REGISTRY["sdpa_cudnn"]
    monkeypatch.setattr(type(backend), "_torch_pick", lambda *a: int(SDPBackend.FLASH_ATTENTION))
    q = torch.randn(1, 8, 2, 16)
    call, params = Inputs(q, q, q, causal=True, window=(2, 0)).prepare()
    assert backend.bind(call, params, q, q, q).__name__ == "forced"


def test_decode_causal_is_no_mask_and_window_under_causal_keeps_its_left_side():
    from attnkit.runtime.call import Inputs

    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 40, 4, 16)
    call = Inputs(q, k, k, causal=True).describe()
    assert call.causal is False  # one query sees every key bottom-right
    q2 = torch.randn(2, 4, 4, 16)
    assert Inputs(q2, k, k, causal=True, window=(8, 5)).describe().window == (8, 0)
    assert Inputs(q2, k, k, causal=True, window=(-1, 3)).describe().window is None
    assert Inputs(q2, k, k, causal=True, window=(8, 5)).describe().causal is True
    out = attnkit.attention(q, k, k, causal=True)
    torch.testing.assert_close(out.double(), reference_attention(q, k, k, causal=True), atol=1e-5, rtol=1e-5)


def test_window_mask_is_built_once_per_shape(monkeypatch):
    from attnkit.runtime import layout
    from attnkit.runtime.dispatch import _DENSE as _FAST

    _FAST.clear()
    layout.cached_mask.cache_clear()
    built: list = []
    real = layout.allowed_mask
    monkeypatch.setattr(layout, "allowed_mask", lambda *a, **kw: built.append(a) or real(*a, **kw))
    q = torch.randn(2, 24, 2, 16)
    for batch in (2, 2, 2, 3):  # a new batch size is a new call signature, but the same mask
        qb = q[:1].expand(batch, -1, -1, -1).contiguous()
        out = attnkit.attention(qb, qb, qb, causal=True, window=(4, 0))
    assert len(built) == 1
    torch.testing.assert_close(out.double(), reference_attention(qb, qb, qb, causal=True, window=(4, 0)),
                               atol=1e-5, rtol=1e-5)


def test_alibi_far_from_the_diagonal_survives_the_cast_to_bf16():
    """flash-attn's test rule failed attnkit on ALiBi, not causal, more queries than keys (bf16): the bias
    reached -150 where bf16's spacing is 1.0. Re-centred per row, the error drops by an order of magnitude."""
    import torch.nn.functional as F

    from attnkit.runtime import layout
    from attnkit.runtime.smoke import CASES, inputs

    inp = inputs(CASES["alibi_cross"], "bfloat16", "cpu")
    q, k, v = (t.detach() for t in (inp.q, inp.k, inp.v))
    ref = reference_attention(q.double(), k.double(), v.double(), alibi_slopes=inp.alibi_slopes)
    out = attnkit.attention(q, k, v, alibi_slopes=inp.alibi_slopes, backend="sdpa_math")
    bias = layout.alibi_bias(inp.alibi_slopes, q.shape[1], k.shape[1]).to(torch.bfloat16)  # the old cast
    old = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=bias).transpose(1, 2)
    err, old_err = (out.double() - ref).abs().max().item(), (old.double() - ref).abs().max().item()
    assert err < 2.5e-2 < old_err and err < old_err / 10, (err, old_err)


def test_import_attnkit_does_not_import_optional_libraries():
    import subprocess
    import sys

    code = ("import sys, attnkit, attnkit.runtime.backends; "
            "print(sorted(m for m in ('torch','flash_attn','xformers','pynvml','rich') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_bucket_plan_covers_every_sequence_once():
    from attnkit.runtime.backends.sdpa_cudnn_varlen import plan_buckets

    lengths = (4096, 17, 0, 2000, 3000, 5, 4000, 1024)
    groups = plan_buckets(lengths)
    flat = sorted(i for g in groups for i in g)
    assert flat == [i for i, n in enumerate(lengths) if n > 0]
    for g in groups:  # each bucket is sorted longest first and buckets do not interleave lengths
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
    padded = sum(len(g) * lengths[g[0]] ** 2 for g in groups)
    assert padded < 0.75 * len([n for n in lengths if n]) * 4096**2  # much less work than one padded batch
    assert plan_buckets((0, 0)) == []


@pytest.mark.parametrize("causal", [True, False])
def test_bucketed_varlen_matches_reference(causal):
    """The cuDNN varlen backend's bucketing, run through SDPA math on CPU."""
    import math

    from attnkit.runtime.backends.sdpa_cudnn_varlen import SdpaCudnnVarlen
    from attnkit.runtime.call import Inputs

    class OnCpu(SdpaCudnnVarlen):
        sdp_name = "MATH"

    torch.manual_seed(4)
    lengths = [9, 0, 3, 12, 1, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = rand(sum(lengths), 4, 16), rand(sum(lengths), 2, 16), rand(sum(lengths), 2, 16)
    c, params = Inputs(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12,
                       max_seqlen_k=12).prepare()
    assert c.varlen_same and params.scale == 1 / math.sqrt(16)
    out = OnCpu().run(q, k, v, c, params)
    ref = reference_attention(q.detach(), k.detach(), v.detach(), causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_varlen_fast_path_is_keyed_by_cu_seqlens_identity_and_version():
    from attnkit.runtime.dispatch import _VARLEN as _FAST_VARLEN

    _FAST_VARLEN.clear()
    torch.manual_seed(5)
    q, k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    a = attnkit.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    assert len(_FAST_VARLEN) == 1
    attnkit.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    assert len(_FAST_VARLEN) == 1
    cu[1] = 7  # in place: new lengths (7, 3) must be read again, not served from the cache
    b = attnkit.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    ref = reference_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(b.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="cu_seqlens_q: ends at 9"):
        attnkit.attention(q, k, v, cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32), cu_seqlens_k=cu,
                          max_seqlen_q=6, max_seqlen_k=7)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, alibi_slopes="heads"), dict(window=(2, 1))])
def test_activation_checkpointing_with_attention_as_the_last_op(use_reentrant, kw):
    """torch.utils.checkpoint around a block whose last op is attention(): the non-reentrant recomputation stops
    early by raising from inside that call (_StopRecomputationError). attention() hands it on instead of taking it
    for a kernel failure (which demoted the backend, warned, and broke the backward: "target_frame.early_stop is
    set"). Gradients equal the block's without checkpointing; no fallback warning."""
    import warnings

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(5)
    q, k, v = rand(2, 9, 4, 8), rand(2, 9, 4, 8), rand(2, 9, 4, 8)
    if kw.get("alibi_slopes") == "heads":
        kw = {**kw, "alibi_slopes": torch.rand(4)}

    def block(q, k, v):
        return attnkit.attention(q * 2, k, v, **kw)

    g = torch.randn(2, 9, 4, 8)
    want = torch.autograd.grad(block(q, k, v), (q, k, v), g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns (RuntimeWarning): none may happen
        checkpoint(block, q, k, v, use_reentrant=use_reentrant).backward(g)  # reentrant takes no autograd.grad
    for t, b in zip((q, k, v), want, strict=True):
        torch.testing.assert_close(t.grad, b)


@pytest.mark.parametrize("name", ["sdpa", "sdpa_flash"])
def test_torchs_own_pick_runs_the_plain_call_not_the_kernels_op(monkeypatch, name):
    """Where the chosen kernel is torch's own pick, the runner is the plain F.scaled_dot_product_attention call:
    the op called from Python cost ~1 us more a forward call on the H100 (tools/probe-direct-route.py)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from attnkit.runtime.backends import REGISTRY, _sdpa
    from attnkit.runtime.call import Inputs

    backend = REGISTRY[name]
    monkeypatch.setattr(type(backend), "_torch_pick", lambda *a: int(SDPBackend.FLASH_ATTENTION))
    monkeypatch.setattr(_sdpa, "_direct", lambda *a: pytest.fail("the kernel's op was asked for torch's own pick"))
    calls: list = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q = torch.randn(1, 8, 2, 16)
    call, params = Inputs(q, q, q, causal=True).prepare()
    runner = backend.bind(call, params, q, q, q)
    assert runner.__name__ == "run_plain"
    out = runner(q, q, q)
    assert calls == [{"is_causal": True}]
    torch.testing.assert_close(out.double(), reference_attention(q, q, q, causal=True), atol=1e-5, rtol=1e-5)


def test_sdpa_asks_torchs_pick_only_where_a_backward_could_need_the_cudnn_hook(monkeypatch):
    """`sdpa` without grad never asks torch's pick (the plain call chooses itself). With a backward on CUDA: where
    torch picks flash, flash's op is called directly (no cuDNN gradient-layout hook needed); where it picks cuDNN,
    the plain call runs with the hook."""
    from dataclasses import replace

    from torch.nn.attention import SDPBackend

    from attnkit.runtime.backends import REGISTRY, _sdpa
    from attnkit.runtime.call import Inputs

    backend = REGISTRY["sdpa"]
    asked: list = []
    pick = {"kernel": int(SDPBackend.FLASH_ATTENTION)}
    monkeypatch.setattr(type(backend), "_torch_pick", lambda *a: asked.append(1) or pick["kernel"])

    def flash_op(q, k, v):
        return q

    direct: list = []
    monkeypatch.setattr(_sdpa, "_direct", lambda kernel, kw, call, guard: direct.append((kernel, guard)) or flash_op)
    q = torch.randn(1, 8, 2, 16)
    call, params = Inputs(q, q, q, causal=True).prepare()
    assert backend.bind(call, params, q, q, q).__name__ == "run_plain" and asked == []
    grad_call = replace(call, device="cuda", requires_grad=True)
    assert backend.bind(grad_call, params, q, q, q) is flash_op
    assert asked == [1] and direct == [(int(SDPBackend.FLASH_ATTENTION), False)]
    pick["kernel"] = int(SDPBackend.CUDNN_ATTENTION)
    runner = backend.bind(grad_call, params, q, q, q)
    assert runner.__name__ == "run" and len(direct) == 1  # the plain call, with the hook around it
    hooked: list = []
    monkeypatch.setattr(_sdpa, "grad_like_output", lambda out: hooked.append(out) or out)
    qg = q.clone().requires_grad_(True)
    out = runner(qg, qg, qg)
    assert out.requires_grad and len(hooked) == 1
