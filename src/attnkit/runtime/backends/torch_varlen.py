"""torch's own varlen FlashAttention-2 (the kernels behind `torch.nn.attention.varlen.varlen_attn`, torch >= 2.10):
packed sequences with no padding work and no extra install. Serves varlen calls only.

The kernels are called as aten's `_flash_attention_forward` / `_flash_attention_backward` pair under one
autograd.Function, not through `varlen_attn`: that wraps the same pair in three torch.library custom ops (forward,
backward, and the generated autograd node between them), whose Python dispatch cost 0.8 ms of host time per
fwd+bwd step on a packed batch of 400 short sequences, against 0.27 ms of GPU time. The same kernels called directly:
0.71 ms per step against torch_varlen's 1.53 and the plain padded SDPA call's 0.93 (H100, 2026-12-05,
docs/results/2026-12-05-h100-probe-varlen-padded-fa2-direct.json). The direct pair is exactly what SDPA's own
autograd formula runs (derivatives.yaml: the forward's rng_state and unused tensors go to the backward)."""

from __future__ import annotations

import functools
from typing import Any

from attnkit.runtime.backends.base import Backend, Limits
from attnkit.runtime.call import AttentionCall, Params


@functools.cache
def _varlen_module() -> Any:
    """The module whose presence says this torch ships varlen FlashAttention as a supported API (>= 2.10)."""
    from torch.nn.attention import varlen

    return varlen


def forward(fwd: Any, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int | None, max_k: int | None, causal: bool,
            scale: float) -> Any:
    """The forward op's one call (no dropout, no debug mask): (out, lse, rng_state, unused, debug)."""
    return fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)


def flash_varlen(fwd: Any, bwd: Any) -> Any:
    """The autograd.Function over a (forward, backward) op pair with aten's `_flash_attention_*` signatures (the
    unit tests pass a math pair with those signatures; `_aten_pair` gives the real one)."""
    import torch

    class FlashVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, causal: bool,
                    scale: float) -> Any:
            out, lse, rng, unused, _ = forward(fwd, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
            ctx.args = (max_q, max_k, causal, scale)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
            max_q, max_k, causal, scale = ctx.args
            dq, dk, dv = bwd(grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng,
                             unused, scale=scale)
            return dq, dk, dv, None, None, None, None, None, None

    return FlashVarlen


@functools.cache
def _aten_pair() -> tuple[Any, Any]:
    import torch

    return torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default


@functools.cache
def _function() -> Any:
    return flash_varlen(*_aten_pair())


def runner(call: AttentionCall, p: Params, fwd: Any, function: Any) -> Any:
    """The per-call work: where no backward can follow, the forward op alone (no Python autograd.Function around
    it), else the autograd.Function. k and v keep their own head count: FlashAttention-2 shares kv heads natively.
    (aten's forward op has an autograd formula of its own, the same backward call; the Function is the route that
    was timed and checked on the GPU, 2026-12-05.)"""
    cu_q, cu_k, max_q, max_k = p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k
    causal, scale = call.causal, p.scale
    if not call.requires_grad:
        return lambda q, k, v: forward(fwd, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)[0]
    return lambda q, k, v: function.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)


class TorchVarlen(Backend):
    name = "torch_varlen"
    limits = Limits(
        min_capability=(8, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        dense=False,
        varlen="native",
    )

    def extra_unavailable(self, probe: Any) -> list[str]:
        try:
            _varlen_module()
        except ImportError:
            return [f"torch {probe.torch.version} has no torch.nn.attention.varlen (needs torch >= 2.10)"]
        return []

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Any:
        return runner(call, p, _aten_pair()[0], _function())
