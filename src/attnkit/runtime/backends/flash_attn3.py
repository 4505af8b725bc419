"""flash-attn 3 (`flash_attn_interface`, Hopper only): for users who built FA3 from flash-attention's hopper/
folder themselves (it is in no PyPI release). No dropout, no ALiBi."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from attnkit.runtime.backends.base import Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params


class FlashAttn3(Backend):
    name = "flash_attn3"
    library = "flash-attn-3"
    # the build carries sm80 units too (matrix.yaml's archs, [fa3-setup]); attention() claims Hopper, the
    # architecture FA3 is written for, until an sm80 GPU has run flash-attn's test grid through it
    limits = Limits(
        min_capability=(9, 0),
        max_capability=(9, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        gqa="native",
        varlen="native",
        window=True,
        softcap=True,
        deterministic_backward=True,
    )

    @staticmethod
    def _module() -> Any:
        name = "flash_attn_interface" if importlib.util.find_spec("flash_attn_interface") else "flash_attn_3"
        return importlib.import_module(name)

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        fa3 = self._module()
        kw: dict[str, Any] = dict(softmax_scale=p.scale, causal=call.causal,
                                  window_size=p.window if p.window is not None else (-1, -1),
                                  deterministic=call.deterministic)
        if call.softcap:
            kw["softcap"] = p.softcap
        if call.varlen:
            fn = fa3.flash_attn_varlen_func
            cu_q, cu_k, mq, mk = p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k

            def varlen(q: Any, k: Any, v: Any) -> Any:
                out = fn(q, k, v, cu_q, cu_k, mq, mk, **kw)
                return out[0] if type(out) is tuple else out  # some releases return (out, lse)
            return varlen
        dense = fa3.flash_attn_func

        def run(q: Any, k: Any, v: Any) -> Any:
            out = dense(q, k, v, **kw)
            return out[0] if type(out) is tuple else out
        return run
