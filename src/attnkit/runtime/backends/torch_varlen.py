"""torch's own varlen FlashAttention (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10): packed
sequences with no padding work and no extra install. Serves varlen calls only."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from attnkit.runtime.backends.base import Backend, Limits
from attnkit.runtime.call import AttentionCall, Params


@functools.cache
def _varlen() -> tuple[Any, frozenset[str]]:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class TorchVarlen(Backend):
    name = "torch_varlen"
    limits = Limits(
        min_capability=(8, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        gqa="expand",
        dense=False,
        varlen="native",
    )

    def extra_unavailable(self, probe: Any) -> list[str]:
        try:
            _varlen()
        except ImportError:
            return [f"torch {probe.torch.version} has no torch.nn.attention.varlen (needs torch >= 2.10)"]
        return []

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Any:
        """The function and its keyword arguments are worked out once per bound call."""
        from attnkit.runtime import layout

        fn, params = _varlen()
        kwargs: dict[str, Any] = {"scale": p.scale}
        expand = call.gqa and "enable_gqa" not in params
        if call.gqa and not expand:
            kwargs["enable_gqa"] = True
        if call.causal:
            if "is_causal" in params:
                kwargs["is_causal"] = True
            else:
                kwargs["window_size"] = (-1, 0)
        cu_q, cu_k, max_q, max_k = p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k
        heads = call.heads

        def run(q: Any, k: Any, v: Any) -> Any:
            if expand:
                k, v = layout.expand_kv(k, heads), layout.expand_kv(v, heads)
            return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        return run
