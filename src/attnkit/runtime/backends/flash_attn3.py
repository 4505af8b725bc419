"""flash-attn 3 (`flash_attn_interface`, Hopper only): fastest FlashAttention on sm90; no dropout, no ALiBi."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from attnkit.runtime.backends.base import Backend, Limits, Params
from attnkit.runtime.call import AttentionCall


class FlashAttn3(Backend):
    name = "flash_attn3"
    library = "flash-attn-3"
    limits = Limits(
        min_capability=(9, 0),
        max_capability=(9, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        gqa="native",
        varlen="native",
        window=True,
        deterministic_backward=True,
    )

    @staticmethod
    def _module() -> Any:
        name = "flash_attn_interface" if importlib.util.find_spec("flash_attn_interface") else "flash_attn_3"
        return importlib.import_module(name)

    def run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:
        fa3 = self._module()
        window = p.window if p.window is not None else (-1, -1)
        common = dict(softmax_scale=p.scale, causal=call.causal, window_size=window,
                      deterministic=call.deterministic)
        if call.varlen:
            out = fa3.flash_attn_varlen_func(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q,
                                             p.max_seqlen_k, **common)
        else:
            out = fa3.flash_attn_func(q, k, v, **common)
        return out[0] if isinstance(out, tuple) else out  # some releases return (out, lse)
