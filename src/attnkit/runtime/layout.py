"""Layout conversions and masks shared by backends: pack/unpack varlen, GQA expansion, and the one mask
builder that encodes attnkit's semantics (bottom-right causal, windows, ALiBi) for mask-based kernels."""

from __future__ import annotations

from typing import Any


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
    lengths = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.zeros(b + 1, dtype=torch.int32, device=x.device)
    cu[1:] = torch.cumsum(lengths, dim=0, dtype=torch.int32)
    packed = x.reshape(b * s, *x.shape[2:]).index_select(0, indices)
    return packed, indices, cu, int(lengths.max().item()) if b else 0


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
    ok = j < lk
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


def safe_rows(ok: Any) -> tuple[Any, Any]:
    """(mask with a key opened in every empty row, empty-row mask (B|1, 1, sq, 1)).

    Rows that see no key must give zeros, not NaN: the opened key keeps softmax finite (so gradients stay
    finite too) and the caller zeroes those rows afterwards.
    """
    empty = ~ok.any(dim=-1, keepdim=True)
    if bool(empty.any()):
        first = ok.new_zeros(ok.shape[-1])
        first[0] = True
        ok = ok | (empty & first)
    return ok, empty
