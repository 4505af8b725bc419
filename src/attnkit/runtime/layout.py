"""Layout conversions and masks shared by backends: pack/unpack varlen, GQA expansion, and the one mask
builder that encodes attnkit's semantics (bottom-right causal, windows, ALiBi) for mask-based kernels."""

from __future__ import annotations

import functools
from typing import Any

MASK_CACHE_SIZE = 16  # dense masks kept per process (one S=16384 boolean mask is 256 MiB)


def lengths_from_cu(cu_seqlens: Any) -> Any:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def pack(x: Any, keep: Any) -> tuple[Any, Any, Any, int]:
    """Padded (batch, seqlen, ...) -> packed (total, ...).

    `keep` is a bool mask (batch, seqlen) of real tokens, or an int tensor of per-sequence lengths
    (tokens first, padding after). Returns (packed, indices, cu_seqlens int32, max_seqlen).
    """
    import torch

    b, s = x.shape[0], x.shape[1]
    if keep.dtype == torch.bool:
        if tuple(keep.shape) != (b, s):
            raise ValueError(f"keep: mask shape {tuple(keep.shape)} is not (batch, seqlen) = ({b}, {s})")
        mask = keep
    else:
        if keep.dim() != 1 or keep.shape[0] != b:
            raise ValueError(f"keep: lengths shape {tuple(keep.shape)} is not (batch,) = ({b},)")
        if bool((keep < 0).any()) or bool((keep > s).any()):
            raise ValueError(f"keep: lengths must be within [0, {s}]")
        mask = torch.arange(s, device=x.device)[None, :] < keep.to(x.device)[:, None]
    indices, cu, max_len = mask_indices(mask)
    packed = x.reshape(b * s, *x.shape[2:]).index_select(0, indices)
    return packed, indices, cu, max_len


def mask_indices(mask: Any) -> tuple[Any, Any, int]:
    """A bool (batch, seqlen) mask of real tokens -> (indices of those tokens in the flattened batch,
    cu_seqlens int32, max_seqlen). Reads the lengths on the host once."""
    import torch

    lengths = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu, int(lengths.max().item()) if mask.shape[0] else 0


def unpack(packed: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """Packed (total, ...) -> padded (batch, seqlen, ...), zeros where there is no token."""
    out = packed.new_zeros(batch * seqlen, *packed.shape[1:])
    out = out.index_copy(0, indices, packed)
    return out.reshape(batch, seqlen, *packed.shape[1:])


def varlen_indices(cu_seqlens: Any, seqlen: int) -> Any:
    """Indices into a (batch*seqlen) padded buffer for each packed row."""
    import torch

    lengths = lengths_from_cu(cu_seqlens)
    mask = torch.arange(seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]
    return torch.nonzero(mask.flatten(), as_tuple=False).flatten()


def expand_kv(x: Any, heads: int) -> Any:
    """(..., kv_heads, D) -> (..., heads, D), materialised: only for kernels without native GQA."""
    kv = x.shape[-2]
    if kv == heads:
        return x
    g = heads // kv
    return x.unsqueeze(-2).expand(*x.shape[:-1], g, x.shape[-1]).reshape(*x.shape[:-2], heads, x.shape[-1])


def allowed_mask(sq: int, sk: int, *, causal: bool, window: tuple[int, int] | None, device: Any,
                 lengths_q: Any = None, lengths_k: Any = None) -> Any:
    """Bool (B|1, 1, sq, sk): True where query i may attend key j.

    Alignment is bottom-right per sequence: the diagonal of query i is key i + len_k - len_q.
    With lengths (varlen unpacked to padding), padded keys are excluded.
    """
    import torch

    i = torch.arange(sq, device=device)[None, :, None]
    j = torch.arange(sk, device=device)[None, None, :]
    if lengths_q is not None:
        lq, lk = lengths_q[:, None, None], lengths_k[:, None, None]
    else:
        lq = torch.full((1, 1, 1), sq, device=device)
        lk = torch.full((1, 1, 1), sk, device=device)
    d = j - (i + lk - lq)  # distance from the aligned diagonal
    ok = (j < lk).expand(-1, sq, -1)  # every row, also where no causal/window term broadcasts it
    if causal:
        ok = ok & (d <= 0)
    if window is not None:
        left, right = window
        if left >= 0:
            ok = ok & (d >= -left)
        if right >= 0:
            ok = ok & (d <= right)
    return ok[:, None]  # (B|1, 1, sq, sk)


def alibi_bias(slopes: Any, sq: int, sk: int, lengths_q: Any = None, lengths_k: Any = None) -> Any:
    """Float (B|1, H, sq, sk): -slope * |distance from the aligned diagonal| (flash-attn's ALiBi)."""
    import torch

    device = slopes.device
    i = torch.arange(sq, device=device)[None, :, None]
    j = torch.arange(sk, device=device)[None, None, :]
    if lengths_q is not None:
        off = (lengths_k - lengths_q)[:, None, None]
    else:
        off = torch.full((1, 1, 1), sk - sq, device=device)
    dist = (j - (i + off)).abs().float()  # (B|1, sq, sk)
    s = slopes if slopes.dim() == 2 else slopes[None]  # (B|1, H)
    return -s[:, :, None, None] * dist[:, None]


def dense_bias(ok: Any, dtype: Any, *, alibi_slopes: Any = None, attn_bias: Any = None, lengths_q: Any = None,
               lengths_k: Any = None) -> Any:
    """The additive float mask of a mask-based kernel: ALiBi + attn_bias, -inf where `ok` is False, each row
    shifted so that its largest value is 0, then cast to the kernel's dtype.

    Why the shift: softmax is shift-invariant per row, the cast is not. ALiBi reaches -slope * distance,
    about -150 in rows far from the diagonal (more queries than keys, not causal), where bf16's spacing is
    1.0: the cast moved logits by up to 0.5 (flash-attn's own test rule caught it; flash-attn keeps the bias
    in fp32). Shifted, the values that carry the weight sit near 0, where the cast is exact to ~0.4%."""
    import torch

    sq, sk = ok.shape[-2], ok.shape[-1]
    bias = torch.zeros((), dtype=torch.float32, device=ok.device)
    if alibi_slopes is not None:
        bias = bias + alibi_bias(alibi_slopes, sq, sk, lengths_q, lengths_k)
    if attn_bias is not None:
        bias = bias + attn_bias.float()
    bias = bias.masked_fill(~ok, float("-inf"))
    top = bias.detach().amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), device=top.device))
    return (bias - top).to(dtype)


class BiasCache:
    """Dense biases of mask-based kernels (SDPA, xformers) kept per (slopes / attn_bias tensor identity and
    in-place version, mask, dtype, lengths), so a model that passes the same ALiBi slopes to every layer and
    every step pays one build, not one per call: the plain call a user writes builds its bias once too (on the
    H200, an fp32 bias rebuilt per call made SDPA 2.2x slower: docs/results/2026-12-01-h200-flex-alibi.json). An in-place change of the
    tensor bumps its version: a new entry. An entry goes when its tensor dies (a per-step slopes tensor frees its
    bias with the step) or when it is the oldest of MAX; a tensor that requires grad is never cached (the bias
    must stay in its autograd graph)."""

    MAX = 4  # one S=8192, 16-head bf16 bias is 2 GiB: a handful, not a table

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        self.builds = 0  # dense biases built (tests and reports read it)

    def get(self, ok: Any, dtype: Any, *, alibi_slopes: Any = None, attn_bias: Any = None,
            cu_seqlens_q: Any = None, cu_seqlens_k: Any = None) -> Any:
        """dense_bias(ok, dtype, ...) for a varlen call's padded layout when cu_seqlens are given."""
        import weakref

        def build() -> Any:
            self.builds += 1
            lq = lk = None
            if cu_seqlens_q is not None:
                lq, lk = lengths_from_cu(cu_seqlens_q), lengths_from_cu(cu_seqlens_k)
            return dense_bias(ok, dtype, alibi_slopes=alibi_slopes, attn_bias=attn_bias, lengths_q=lq, lengths_k=lk)

        values = tuple(t for t in (alibi_slopes, attn_bias) if t is not None)
        if any(t.requires_grad for t in values):
            return build()
        tensors = (ok, *values, *(t for t in (cu_seqlens_q, cu_seqlens_k) if t is not None))
        key = (dtype, alibi_slopes is None, *((id(t), t._version) for t in tensors))
        hit = self._entries.get(key)
        if hit is not None and all(r() is t for r, t in zip(hit[1], tensors, strict=True)):
            return hit[0]
        bias = build()
        if len(self._entries) >= self.MAX:
            self._entries.pop(next(iter(self._entries)))
        entries = self._entries

        def gone(_: Any, key: tuple[Any, ...] = key) -> None:
            entries.pop(key, None)
        self._entries[key] = (bias, tuple(weakref.ref(t, gone) for t in tensors))
        return bias

    def clear(self) -> None:
        self._entries.clear()


BIASES = BiasCache()


def safe_rows(ok: Any) -> tuple[Any, Any]:
    """(mask with a key opened in every empty row, empty-row mask (B|1, 1, sq, 1)).

    Rows that see no key must give zeros, not NaN: the opened key keeps softmax finite (so gradients stay
    finite too) and the caller zeroes those rows afterwards.
    """
    empty = ~ok.any(dim=-1, keepdim=True)
    if bool(empty.any()) and ok.shape[-1]:  # no key at all: nothing to open, every row is zeroed
        first = ok.new_zeros(ok.shape[-1])
        first[0] = True
        ok = ok | (empty & first)
    return ok, empty


def graph_mask(sq: Any, sk: Any, causal: bool, window: tuple[int, int] | None, device: Any) -> tuple[Any, Any]:
    """cached_mask's result, built inside a torch.compile graph: sizes may be SymInts and nothing is read
    on the host, so the first key is opened in every row and the empty-row mask is always returned (all
    False unless some row sees no key)."""
    import torch

    ok = allowed_mask(sq, sk, causal=causal, window=window, device=device)
    empty = ~ok.any(dim=-1, keepdim=True)
    first = torch.arange(sk, device=device) == 0
    return ok | (empty & first), empty


@functools.lru_cache(maxsize=MASK_CACHE_SIZE)
def cached_mask(sq: int, sk: int, causal: bool, window: tuple[int, int] | None, device: Any,
                lengths: tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None = None) -> tuple[Any, Any]:
    """(allowed mask with one key opened in every row that sees none, those rows or None), cached per shape:
    a window or varlen mask is built once, not on every call. `lengths` are the per-sequence (query, key)
    lengths of a varlen call, unpacked to padding. Its one host sync (are there empty rows?) is paid here."""
    import torch

    lq = lk = None
    if lengths is not None:
        lq = torch.tensor(lengths[0], device=device)
        lk = torch.tensor(lengths[1], device=device)
    ok = allowed_mask(sq, sk, causal=causal, window=window, device=device, lengths_q=lq, lengths_k=lk)
    ok, empty = safe_rows(ok)
    return ok, (empty if bool(empty.any()) else None)


def eager_sdpa(q: Any, k: Any, v: Any, *, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False, softcap: float = 0.0) -> Any:
    """F.scaled_dot_product_attention's math, written out, for what SDPA has no argument for: softcap
    (softcap * tanh(score / softcap), as flash-attn applies it to the scaled scores). (B, H, S, D) layout;
    half-precision inputs are computed in float32."""
    import torch

    if enable_gqa and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(work) @ k.to(work).transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(work))
    p = torch.softmax(scores, dim=-1)
    if dropout_p:
        p = torch.nn.functional.dropout(p, dropout_p)
    return (p @ v.to(work)).to(q.dtype)
