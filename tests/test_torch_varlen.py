"""torch_varlen's direct route (aten's varlen FlashAttention pair under one autograd.Function), wired up on the CPU
with a math pair of the same signatures: what the forward saves, what reaches the backward, and which gradient goes
to which input. The kernels themselves run on the GPU (`attnkit oracle --backend torch_varlen`, the smoke)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from attnkit.runtime.backends import torch_varlen as tv  # noqa: E402


def _math(q, k, v, cu_q, cu_k, causal, scale):
    """Per sequence, k/v heads shared by groups of q heads, causal aligned bottom-right (FlashAttention-2's)."""
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].float()
        ks = k[cu_k[i]:cu_k[i + 1]].float().repeat_interleave(group, 1)
        vs = v[cu_k[i]:cu_k[i + 1]].float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            lq, lk = qs.shape[0], ks.shape[0]
            allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            s = s.masked_fill(~allowed, -math.inf)
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs).to(q.dtype))
    return torch.cat(outs), torch.cat(lses, 1)


CALLS: list[str] = []


def _longest(cu):
    return int((cu[1:] - cu[:-1]).max())


def fake_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
    CALLS.append("fwd")
    assert dropout_p == 0.0 and return_debug_mask is False
    assert (max_q, max_k) == (_longest(cu_q), _longest(cu_k))  # the tests' lengths: the maxima differ
    out, lse = _math(q, k, v, cu_q, cu_k, is_causal, scale)
    return out, lse, torch.tensor([7, 9]), torch.empty(0), torch.empty(0)


def fake_bwd(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *, scale=None):
    CALLS.append("bwd")
    assert (max_q, max_k) == (_longest(cu_q), _longest(cu_k)) and dropout_p == 0.0
    assert rng.tolist() == [7, 9] and unused.numel() == 0  # the forward's own, as SDPA's autograd formula passes
    assert torch.equal(out, _math(q, k, v, cu_q, cu_k, is_causal, scale)[0])
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        ref = _math(*leaves, cu_q, cu_k, is_causal, scale)[0]
        return torch.autograd.grad(ref, leaves, grad)


def _packed(kv_heads: int, lengths_q: list[int], lengths_k: list[int]):
    g = torch.Generator().manual_seed(0)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lengths_q), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), kv_heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    p = SimpleNamespace(cu_seqlens_q=cu(lengths_q), cu_seqlens_k=cu(lengths_k), max_seqlen_q=max(lengths_q),
                        max_seqlen_k=max(lengths_k), scale=0.3)
    return q, k, v, p


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_reach_their_inputs(kv_heads, causal):
    q, k, v, p = _packed(kv_heads, [3, 1, 5], [4, 2, 7])
    fn = tv.runner(SimpleNamespace(causal=causal, requires_grad=True), p, fake_fwd, tv.flash_varlen(fake_fwd, fake_bwd))
    CALLS.clear()
    out = fn(q, k, v)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert CALLS == ["fwd", "bwd"]
    got = [t.grad for t in (q, k, v)]
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = _math(*ref_leaves, p.cu_seqlens_q, p.cu_seqlens_k, causal, p.scale)[0]
    assert torch.allclose(out, ref)
    want = torch.autograd.grad(ref, ref_leaves, grad)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b), name  # kv grads summed over the heads sharing them


def test_a_call_no_backward_follows_runs_the_forward_op_alone():
    q, k, v, p = _packed(2, [2, 6], [3, 8])

    class NoFunction:
        @staticmethod
        def apply(*args):
            raise AssertionError("a forward-only call went through the autograd.Function")

    fn = tv.runner(SimpleNamespace(causal=True, requires_grad=False), p, fake_fwd, NoFunction)
    CALLS.clear()
    with torch.no_grad():
        out = fn(q, k, v)
    assert CALLS == ["fwd"] and out.grad_fn is None
    assert torch.allclose(out, _math(q.detach(), k.detach(), v.detach(), p.cu_seqlens_q, p.cu_seqlens_k, True, 0.3)[0])


@pytest.mark.parametrize("requires_grad", [True, False])
def test_the_real_aten_pair_takes_these_arguments_on_meta_tensors(requires_grad):
    """aten's own ops (their meta kernels: the shapes and the argument binding, no CUDA kernel), GQA 8/2 with kv
    heads native: the output has q's shape, the gradients their inputs' shapes."""
    q = torch.empty(37, 8, 64, device="meta", dtype=torch.float16, requires_grad=True)
    k, v = (torch.empty(41, 2, 64, device="meta", dtype=torch.float16, requires_grad=True) for _ in range(2))
    cu = torch.empty(4, device="meta", dtype=torch.int32)
    p = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20, max_seqlen_k=25, scale=0.125)
    out = tv.runner(SimpleNamespace(causal=True, requires_grad=requires_grad), p, tv._aten_pair()[0],
                    tv._function())(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    if requires_grad:
        out.backward(torch.empty_like(out))
        assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]


def test_the_real_pair_is_aten_flash_attention():
    fwd, bwd = tv._aten_pair()
    assert "_flash_attention_forward" in str(fwd) and "_flash_attention_backward" in str(bwd)
    # the signature the Function calls with: the arguments by name, as aten declares them
    args = [a.name for a in fwd._schema.arguments]
    assert args[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                         "return_debug_mask"] and "scale" in args
    args = [a.name for a in bwd._schema.arguments]
    assert args[:14] == ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                         "max_k", "dropout_p", "is_causal", "rng_state", "unused"] and "scale" in args
