"""The one call-spec type (`Shape`) of every harness that makes attention calls of its own: the bench and the tune
sweep, the smoke, warmup. And the one place where a spec becomes tensors (`make_inputs`): q, k, v, cu_seqlens and
ALiBi slopes are built here and nowhere else, so a harness cannot test a layout the others do not."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Shape:
    label: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = True
    window: tuple[int, int] | None = None
    lengths: tuple[int, ...] | None = None  # packed varlen: the sequences' query lengths (and key lengths)
    train: bool = True  # forward+backward too
    alibi: bool = False  # ALiBi with the usual geometric slopes (2^(-8 h / heads))
    softcap: float = 0.0
    lengths_k: tuple[int, ...] | None = None  # packed varlen with other key lengths (cross-attention, keyless rows)

    @property
    def key_lengths(self) -> tuple[int, ...] | None:
        return self.lengths_k if self.lengths_k is not None else self.lengths


def varlen(label: str, lengths: tuple[int, ...], lengths_k: tuple[int, ...] | None = None, **kw: Any) -> Shape:
    """A packed varlen shape: batch and the padded sizes follow from the lengths."""
    keys = lengths if lengths_k is None else lengths_k
    return Shape(label, batch=len(lengths), seqlen_q=max(lengths), seqlen_k=max(keys), lengths=lengths,
                 lengths_k=lengths_k, **kw)


class Tensors(NamedTuple):
    q: Any
    k: Any
    v: Any
    kw: dict[str, Any]  # attention()'s keyword arguments for this shape
    generator: Any  # for the caller's further draws (an output gradient), after q, k, v


def alibi_slopes(heads: int, device: Any) -> Any:
    import torch

    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device, dtype=torch.float32)


def make_inputs(s: Shape, device: str, *, host_rng: bool = False, requires_grad: bool = False,
                seed: int = 0) -> Tensors:
    """The shape's tensors, seeded. `host_rng`: drawn in float32 on the CPU, then moved and cast, so that every
    device and dtype sees the same numbers (the smoke compares backends against one float64 reference); else
    drawn on the device in the shape's dtype (the bench's tensors can be tens of GiB)."""
    import torch

    dt = getattr(torch, s.dtype)
    gen = torch.Generator(device="cpu" if host_rng else device).manual_seed(seed)

    def r(*shape: int) -> Any:
        t = (torch.randn(*shape, generator=gen).to(device=device, dtype=dt) if host_rng else
             torch.randn(*shape, generator=gen, device=device, dtype=dt))
        return t.requires_grad_(requires_grad)

    kw: dict[str, Any] = {"causal": s.causal, "window": s.window, "softcap": s.softcap}
    keys = s.key_lengths
    if s.lengths is not None and keys is not None:
        for name, lens in (("q", s.lengths), ("k", keys)):
            kw[f"cu_seqlens_{name}"] = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
            kw[f"max_seqlen_{name}"] = max(lens)
        if s.lengths_k is None:  # self-attention: one cu_seqlens tensor for both, as a model passes it
            kw["cu_seqlens_k"] = kw["cu_seqlens_q"]
        q = r(sum(s.lengths), s.heads, s.head_dim)
        k, v = r(sum(keys), s.kv_heads, s.head_dim), r(sum(keys), s.kv_heads, s.head_dim)
    else:
        q = r(s.batch, s.seqlen_q, s.heads, s.head_dim)
        k, v = r(s.batch, s.seqlen_k, s.kv_heads, s.head_dim), r(s.batch, s.seqlen_k, s.kv_heads, s.head_dim)
    if s.alibi:
        kw["alibi_slopes"] = alibi_slopes(s.heads, device)
    return Tensors(q, k, v, kw, gen)
