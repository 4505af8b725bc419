"""Shared run() for the four torch SDPA sub-backends; each sub-backend module only declares its limits.

Converts attnkit's (B, S, H, D) / varlen semantics to SDPA's (B, H, S, D) with top-left `is_causal`:
bottom-right causal with seqlen_q != seqlen_k goes through torch's `causal_lower_right` bias where the
kernel supports it, otherwise through an explicit mask from `layout.allowed_mask`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from attnkit.runtime import layout
from attnkit.runtime.backends.base import Backend, Params
from attnkit.runtime.call import AttentionCall


@functools.cache
def _sdp_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


class SdpaBackend(Backend):
    sdp_name: str = ""  # torch.nn.attention.SDPBackend member
    # Where torch's CausalBias (lower_right) is exact for this kernel, so no dense mask is needed:
    # "any", "wide" (only seqlen_q <= seqlen_k; measured wrong for sdpa_efficient when seqlen_q > seqlen_k
    # on the H200, torch 2.11), or "none".
    causal_bias: str = "any"

    def extra_unavailable(self, probe: Any) -> list[str]:
        try:
            from torch.nn.attention import SDPBackend
        except ImportError:
            return ["this torch has no torch.nn.attention.SDPBackend (needs torch >= 2.3)"]
        if not hasattr(SDPBackend, self.sdp_name):
            return [f"this torch has no SDPBackend.{self.sdp_name}"]
        return []

    def run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        lengths_q = lengths_k = idx_q = None
        if call.varlen:
            lengths_q = layout.lengths_from_cu(p.cu_seqlens_q)
            lengths_k = layout.lengths_from_cu(p.cu_seqlens_k)
            idx_q = layout.varlen_indices(p.cu_seqlens_q, call.seqlen_q)
            idx_k = layout.varlen_indices(p.cu_seqlens_k, call.seqlen_k)
            q = layout.unpack(q, idx_q, call.batch, call.seqlen_q)
            k = layout.unpack(k, idx_k, call.batch, call.seqlen_k)
            v = layout.unpack(v, idx_k, call.batch, call.seqlen_k)
        kwargs: dict[str, Any] = {"dropout_p": p.dropout_p}
        if abs(p.scale * math.sqrt(call.head_dim) - 1.0) > 1e-12:  # SDPA's default is 1/sqrt(head_dim)
            kwargs["scale"] = p.scale
        if call.gqa:
            if self.limits.gqa == "native":
                kwargs["enable_gqa"] = True
            else:
                k, v = layout.expand_kv(k, call.heads), layout.expand_kv(v, call.heads)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sq, sk = call.seqlen_q, call.seqlen_k
        needs_mask = call.varlen or call.window is not None or call.alibi or call.bias
        empty = None
        if not needs_mask and (not call.causal or sq == sk):
            kwargs["is_causal"] = call.causal
        elif not needs_mask and (self.causal_bias == "any" or (self.causal_bias == "wide" and sq <= sk)):
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(sq, sk)
            if sq > sk:  # the first sq - sk queries see no key
                empty = (layout.allowed_mask(sq, sk, causal=True, window=None, device=q.device)
                         .any(-1, keepdim=True).logical_not())
        else:
            ok = layout.allowed_mask(sq, sk, causal=call.causal, window=call.window, device=q.device,
                                     lengths_q=lengths_q, lengths_k=lengths_k)
            ok, empty = layout.safe_rows(ok)
            if call.alibi or call.bias:
                bias = qt.new_zeros(())
                if call.alibi:
                    bias = bias + layout.alibi_bias(p.alibi_slopes, sq, sk, lengths_q, lengths_k).to(qt.dtype)
                if call.bias:
                    bias = bias + p.attn_bias.to(qt.dtype)
                kwargs["attn_mask"] = bias.masked_fill(~ok, float("-inf"))
            else:
                kwargs["attn_mask"] = ok
        with sdpa_kernel([_sdp_backend(self.sdp_name)]):
            out = F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        out = out.transpose(1, 2)
        if call.varlen:
            assert idx_q is not None
            out = out.reshape(call.batch * sq, *out.shape[2:]).index_select(0, idx_q)
        return out
