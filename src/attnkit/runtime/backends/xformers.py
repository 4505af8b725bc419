"""xformers `memory_efficient_attention`: the fast path on V100 (sm70) where FlashAttention cannot run.

Bottom-right causal, windows and varlen map to xformers' attention-bias classes; GQA uses its 5-D
(B, M, G, H, K) form with stride-0 expanded k/v (no copy)."""

from __future__ import annotations

from typing import Any

from attnkit.runtime import layout
from attnkit.runtime.backends.base import Backend, Limits, Params
from attnkit.runtime.call import AttentionCall


class Xformers(Backend):
    name = "xformers"
    library = "xformers"
    limits = Limits(
        min_capability=(7, 0),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        max_head_dim=256,
        head_dim_v_differs=True,
        gqa="native",
        varlen="native",
        bias=True,
        alibi=True,
        dropout=True,
    )

    def run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:
        from xformers.ops import fmha

        bias: Any = None
        if call.varlen:
            ql = layout.lengths_from_cu(p.cu_seqlens_q).tolist()
            kl = layout.lengths_from_cu(p.cu_seqlens_k).tolist()
            bd = fmha.attn_bias.BlockDiagonalMask.from_seqlens(ql, kl)
            bias = bd.make_causal_from_bottomright() if call.causal else bd
            q, k, v = q[None], k[None], v[None]
        elif call.alibi or call.bias:
            sq, sk = call.seqlen_q, call.seqlen_k
            ok = layout.allowed_mask(sq, sk, causal=call.causal, window=None, device=q.device)
            ok, _ = layout.safe_rows(ok)
            dense = q.new_zeros((call.batch, call.heads, sq, sk))
            if call.alibi:
                dense = dense + layout.alibi_bias(p.alibi_slopes, sq, sk).to(q.dtype)
            if call.bias:
                dense = dense + p.attn_bias.to(q.dtype)
            bias = dense.masked_fill(~ok, float("-inf"))
        elif call.causal:
            bias = fmha.attn_bias.LowerTriangularFromBottomRightMask()
        if call.gqa:
            g, hq = call.kv_heads, call.heads // call.kv_heads
            q = q.reshape(*q.shape[:-2], g, hq, q.shape[-1])
            k = k.unsqueeze(-2).expand(*k.shape[:-1], hq, k.shape[-1])
            v = v.unsqueeze(-2).expand(*v.shape[:-1], hq, v.shape[-1])
        out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias, p=p.dropout_p, scale=p.scale)
        if call.gqa:
            out = out.reshape(*out.shape[:-3], call.heads, out.shape[-1])
        return out[0] if call.varlen else out
