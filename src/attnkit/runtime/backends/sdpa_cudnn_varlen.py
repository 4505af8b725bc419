"""Packed varlen self-attention on cuDNN: sequences are sorted by length into a few buckets, each padded
only to its own longest sequence and run through SDPA's cuDNN kernel.

Why: on the H200 (torch 2.11) cuDNN is ~1.8x FlashAttention-2, but torch's ragged cuDNN route
(aten._cudnn_attention_forward/backward with cu_seqlens, also what nested-tensor SDPA uses) returned wrong
gradients, hit an illegal memory access and ran ~20x slower than padding there
(docs/results/2026-11-30-h200-cudnn-ragged-probe.txt). Measured at 16 x <= 4096 tokens, 44% padding,
fwd+bwd: 0.66x the padded time, vs 0.73x for flash-attn 2's varlen and 0.77x for torch's varlen_attn.
cudnn_ragged (0.47x there) comes first when nvidia-cudnn-frontend is installed; this one serves without it
and for head_dim > 128.

With end-padding and equal query/key lengths per sequence, top-left `is_causal` on the padded bucket is exact
for every real row (a real query never reaches a padded key), so no mask is needed; non-causal calls use a
key-padding mask.
"""

from __future__ import annotations

from typing import Any

from attnkit.runtime.backends._sdpa import grad_like_output
from attnkit.runtime.backends.base import Backend, Limits
from attnkit.runtime.call import AttentionCall, Params

BUCKET_OVERHEAD = 1 << 23  # cost of one more bucket (launches, host work) in (tokens^2) of padded work;
# 1<<20..1<<25 measured on the H200 (16 seqs <= 4096, 16 heads, D128): 4 buckets at 1<<23 was fastest
MAX_BUCKETS = 8


def plan_buckets(lengths: tuple[int, ...]) -> list[list[int]]:
    """Group sequence indices into <= MAX_BUCKETS buckets of similar length, minimising padded work
    (sum of bucket_size * bucket_max^2) plus a per-bucket overhead. Zero-length sequences are dropped."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    if not order:
        return []
    best: tuple[float, list[list[int]]] | None = None
    for k in range(1, min(MAX_BUCKETS, len(order)) + 1):
        size = -(-len(order) // k)
        groups = [order[j:j + size] for j in range(0, len(order), size)]
        cost = sum(len(g) * lengths[g[0]] ** 2 for g in groups) + BUCKET_OVERHEAD * len(groups)
        if best is None or cost < best[0]:
            best = (cost, groups)
    assert best is not None
    return best[1]


class SdpaCudnnVarlen(Backend):
    name = "sdpa_cudnn_varlen"
    sdp_name = "CUDNN_ATTENTION"  # a test swaps in MATH to check the bucketing on CPU
    limits = Limits(
        min_capability=(9, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        gqa="native",
        dense=False,
        varlen="native",
        dropout=True,
    )

    def extra_reasons(self, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
        # buckets are padded per sequence; top-left is_causal is exact only when queries and keys line up
        return [] if not call.varlen or call.varlen_same else [
            "varlen only with cu_seqlens_q == cu_seqlens_k (self-attention)"]

    def extra_unavailable(self, probe: Any) -> list[str]:
        from attnkit.runtime.backends.sdpa_cudnn import SdpaCudnn

        return SdpaCudnn().extra_unavailable(probe)

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Any:
        """The bucket plan depends only on the lengths: made once per bound call, not per call."""
        from torch.nn.attention import SDPBackend

        assert call.lengths_q is not None
        lengths = list(call.lengths_q)
        groups = plan_buckets(call.lengths_q)
        backend = getattr(SDPBackend, self.sdp_name)
        return lambda q, k, v: self._run(q, k, v, call, p, lengths, groups, backend)

    def _run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params, lengths: list[int],
             groups: list[list[int]], backend: Any) -> Any:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        if not groups:
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
        # Copies are contiguous per sequence and every op's backward is one op over all tokens: split (its
        # backward is one cat), cat into a bucket, split the bucket's output back into sequences. Index
        # gathers/scatters and per-bucket slicing of the whole tensor measured slower than the attention.
        pieces = [t.split(lengths) for t in (q, k, v)]
        max_pad = max(lengths[g[0]] - lengths[i] for g in groups for i in g)
        zeros = [t.new_zeros(max_pad, *t.shape[1:]) for t in (q, k, v)]
        out_pieces: dict[int, Any] = {}
        dev = q.device
        with sdpa_kernel([backend]):
            for group in groups:
                n, m = len(group), lengths[group[0]]

                def bucket(which: int, group: list[int] = group, n: int = n, m: int = m) -> Any:
                    parts = []
                    for i in group:
                        parts.append(pieces[which][i])
                        if m > lengths[i]:
                            parts.append(zeros[which][: m - lengths[i]])
                    flat = torch.cat(parts)
                    return flat.view(n, m, *flat.shape[1:]).transpose(1, 2)

                kwargs: dict[str, Any] = {"scale": p.scale, "dropout_p": p.dropout_p, "enable_gqa": call.gqa}
                if call.causal:
                    kwargs["is_causal"] = True
                else:
                    real = torch.tensor([lengths[i] for i in group], device=dev)
                    kwargs["attn_mask"] = (torch.arange(m, device=dev)[None, :] < real[:, None])[:, None, None, :]
                o = F.scaled_dot_product_attention(bucket(0), bucket(1), bucket(2), **kwargs)
                if o.requires_grad:
                    o = grad_like_output(o)
                # one split per bucket drops the padded rows; its backward is one cat
                chunks = o.transpose(1, 2).reshape(n * m, *o.shape[1:2], o.shape[-1]).split(
                    [x for i in group for x in (lengths[i], m - lengths[i])])
                for slot, i in enumerate(group):
                    out_pieces[i] = chunks[2 * slot]
        return torch.cat([out_pieces[i] for i in range(len(lengths)) if lengths[i] > 0])
