"""An independent, slow reference for attnkit's semantics, in float64: used by tests, smoke and bench to
check every backend. Masks are built row by row from the definition, not with layout.allowed_mask."""

from __future__ import annotations

import math
from typing import Any


def _row_range(i: int, lq: int, lk: int, causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """Keys [lo, hi) that query i sees; bottom-right aligned diagonal at i + lk - lq."""
    diag = i + lk - lq
    lo, hi = 0, lk
    if causal:
        hi = min(hi, diag + 1)
    if window is not None:
        left, right = window
        if left >= 0:
            lo = max(lo, diag - left)
        if right >= 0:
            hi = min(hi, diag + right + 1)
    return lo, max(lo, hi)


def _one(q: Any, k: Any, v: Any, scale: float, causal: bool, window: tuple[int, int] | None,
         slopes: Any, bias: Any, softcap: float = 0.0, rows: list[int] | None = None,
         heads: list[int] | None = None) -> Any:
    """q (sq, H, D), k/v (sk, Hkv, D) -> (sq, H, Dv); float64. `rows` / `heads`: compute only those query rows
    and heads (the others stay zero), for a check on samples of a large call."""
    import torch

    sq, h, _ = q.shape
    sk, hkv, dv = k.shape[0], k.shape[1], v.shape[2]
    g = h // hkv
    out = torch.zeros(sq, h, dv, dtype=torch.float64, device=q.device)
    wanted = list(range(sq)) if rows is None else rows
    for head in (range(h) if heads is None else heads):
        kh, vh = k[:, head // g].double(), v[:, head // g].double()
        scores = (q[wanted, head].double() @ kh.T) * scale  # (rows, sk)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if bias is not None:
            scores = scores + bias[head][wanted]
        for r, i in enumerate(wanted):
            lo, hi = _row_range(i, sq, sk, causal, window)
            if hi <= lo:
                continue  # sees no key: zeros
            s = scores[r, lo:hi]
            if slopes is not None:
                diag = i + sk - sq
                s = s - slopes[head] * torch.abs(torch.arange(lo, hi, device=q.device) - diag).double()
            p = torch.softmax(s, dim=0)
            out[i, head] = p @ vh[lo:hi]
    return out


def reference_rows(q: Any, k: Any, v: Any, rows: list[int], heads: list[int], *, causal: bool = False,
                   softmax_scale: float | None = None, window: tuple[int, int] | None = None, alibi_slopes: Any = None,
                   softcap: float = 0.0) -> Any:
    """One sequence's output on sampled query rows and heads, float64: q (sq, H, D), k/v (sk, Hkv, D) ->
    (len(rows), len(heads), Dv). The same definition as reference_attention, at a cost a GPU bench can pay."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    full = _one(q, k, v, scale, causal, None if window == (-1, -1) else window, alibi_slopes, None, softcap,
                rows=rows, heads=heads)
    return full[rows][:, heads]


def reference_attention(q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
                        window: tuple[int, int] | None = None, alibi_slopes: Any = None, attn_bias: Any = None,
                        softcap: float = 0.0, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                        max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> Any:
    """Same arguments and layout as attention() (no dropout); returns float64."""
    import torch

    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q64, k64, v64 = q.double(), k.double(), v.double()
    if window == (-1, -1):
        window = None
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs = []
        for b in range(len(cq) - 1):
            sl = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
            outs.append(_one(q64[cq[b]:cq[b + 1]], k64[ck[b]:ck[b + 1]], v64[ck[b]:ck[b + 1]], scale, causal,
                             window, sl, None, softcap))
        return torch.cat(outs, dim=0)
    outs = []
    for b in range(q.shape[0]):
        sl = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        bb = None
        if attn_bias is not None:
            full = attn_bias.double().expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            bb = full[b]
        outs.append(_one(q64[b], k64[b], v64[b], scale, causal, window, sl, bb, softcap))
    return torch.stack(outs, dim=0)
