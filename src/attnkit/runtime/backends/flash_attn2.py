"""flash-attn 2 (`flash_attn`): native varlen, GQA, bottom-right causal, windows, ALiBi, softcap, dropout and a
deterministic backward. Imported only when this backend is first used."""

from __future__ import annotations

from typing import Any

from attnkit.runtime.backends.base import Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params


class FlashAttn2(Backend):
    name = "flash_attn2"
    library = "flash-attn"
    limits = Limits(
        min_capability=(8, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        gqa="native",
        varlen="native",
        window=True,
        alibi=True,
        dropout=True,
        softcap=True,  # flash-attn >= 2.6
        deterministic_backward=True,
        traces=frozenset({"compile"}),  # flash-attn >= 2.7 registers its kernels as torch.library ops
    )

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        import flash_attn

        kw: dict[str, Any] = dict(dropout_p=p.dropout_p, softmax_scale=p.scale, causal=call.causal,
                                  window_size=p.window if p.window is not None else (-1, -1),
                                  alibi_slopes=p.alibi_slopes, deterministic=call.deterministic)
        if call.softcap:
            kw["softcap"] = p.softcap
        if call.varlen:
            fn = flash_attn.flash_attn_varlen_func
            cu_q, cu_k, mq, mk = p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k
            return lambda q, k, v: fn(q, k, v, cu_q, cu_k, mq, mk, **kw)
        dense = flash_attn.flash_attn_func
        return lambda q, k, v: dense(q, k, v, **kw)
