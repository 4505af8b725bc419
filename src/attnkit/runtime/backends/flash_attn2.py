"""flash-attn 2 (`flash_attn`): native varlen, GQA, bottom-right causal, windows, ALiBi, dropout and a
deterministic backward. Imported only when this backend is first used."""

from __future__ import annotations

from typing import Any

from attnkit.runtime.backends.base import Backend, Limits, Params
from attnkit.runtime.call import AttentionCall


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
        deterministic_backward=True,
    )

    def run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:
        import flash_attn

        window = p.window if p.window is not None else (-1, -1)
        common = dict(dropout_p=p.dropout_p, softmax_scale=p.scale, causal=call.causal, window_size=window,
                      alibi_slopes=p.alibi_slopes, deterministic=call.deterministic)
        if call.varlen:
            return flash_attn.flash_attn_varlen_func(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k,
                                                     p.max_seqlen_q, p.max_seqlen_k, **common)
        return flash_attn.flash_attn_func(q, k, v, **common)
