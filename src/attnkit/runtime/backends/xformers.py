"""xformers `memory_efficient_attention`: the fast path on V100 (sm70) where FlashAttention cannot run.

Bottom-right causal, windows and varlen map to xformers' attention-bias classes. GQA uses its 5-D
(B, M, G, H, K) form with stride-0 expanded k/v (no copy) for inference; with a backward, k/v are repeated
to q's heads, because xformers 0.0.35's backward operators reject the 5-D form (seen on the H200:
"operator does not support BMGHK format"). Its block-diagonal causal mask needs keys >= queries in every
sequence ("Expected `num_keys >= num_queries`")."""

from __future__ import annotations

from typing import Any

from attnkit.runtime import layout
from attnkit.runtime.backends.base import Backend, Limits
from attnkit.runtime.call import AttentionCall, Params
from attnkit.runtime.loaders import load_fmha


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
        alibi_bias=True,
        dropout=True,
    )

    def extra_reasons(self, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
        # its block-diagonal bottom-right causal mask: "Expected `num_keys >= num_queries`"
        if call.varlen and call.causal and any(
                lq > lk for lq, lk in zip(call.lengths_q or (), call.lengths_k or (), strict=True)):
            return ["varlen causal only when every sequence has at least as many keys as queries"]
        return []

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Any:
        """A varlen call's block-diagonal mask depends only on the lengths: built once per bound call."""
        fmha = load_fmha()
        varlen_bias = None
        if call.varlen:
            assert call.lengths_q is not None and call.lengths_k is not None
            bd = fmha.attn_bias.BlockDiagonalMask.from_seqlens(list(call.lengths_q), list(call.lengths_k))
            varlen_bias = bd.make_causal_from_bottomright() if call.causal else bd
        return lambda q, k, v: self._run(q, k, v, call, p, fmha, varlen_bias)

    def _run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params, fmha: Any, varlen_bias: Any) -> Any:
        bias: Any = None
        empty: Any = None
        dense = False
        if call.varlen:
            bias = varlen_bias
            q, k, v = q[None], k[None], v[None]
        elif call.alibi or call.bias or (call.causal and call.seqlen_q > call.seqlen_k):
            # a dense bias; causal with more queries than keys comes here too: the first sq - sk rows see no
            # key, and xformers' fp32 kernel left garbage there (max error 3.1 on the H200); one opened key
            # keeps them finite and they are zeroed after the kernel
            sq, sk = call.seqlen_q, call.seqlen_k
            ok, empty = layout.cached_mask(sq, sk, call.causal, None, q.device)
            # xformers wants the bias rows 8-element aligned: allocate padded, use a view
            bias = q.new_empty((call.batch, call.heads, sq, -(-sk // 8) * 8))[..., :sk]
            bias.copy_(layout.BIASES.get(ok, q.dtype, alibi_slopes=p.alibi_slopes, attn_bias=p.attn_bias)
                       .expand(call.batch, call.heads, sq, sk))
            dense = True
        elif call.causal:
            bias = fmha.attn_bias.LowerTriangularFromBottomRightMask()
        expand = call.gqa and (call.requires_grad or dense)  # 5-D form: no backward, no dense bias
        if expand:
            k, v = layout.expand_kv(k, call.heads), layout.expand_kv(v, call.heads)
        elif call.gqa:
            g, hq = call.kv_heads, call.heads // call.kv_heads
            q = q.reshape(*q.shape[:-2], g, hq, q.shape[-1])
            k = k.unsqueeze(-2).expand(*k.shape[:-1], hq, k.shape[-1])
            v = v.unsqueeze(-2).expand(*v.shape[:-1], hq, v.shape[-1])
        out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias, p=p.dropout_p, scale=p.scale)
        if call.gqa and not expand:
            out = out.reshape(*out.shape[:-3], call.heads, out.shape[-1])
        if empty is not None:  # all-False unless some row sees no key: no host sync to find out
            out = out.masked_fill(empty.transpose(1, 2), 0.0)  # (1, sq, 1, 1) over (B, sq, H, D)
        return out[0] if call.varlen else out
