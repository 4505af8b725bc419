"""Hugging Face transformers: `attn_implementation="attnkit"`.

    import attnkit.integrations.transformers  # registers "attnkit" (also done by register())
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnkit")
    model.set_attn_implementation("attnkit")   # or switch a loaded model

HF calls attention with (batch, heads, seqlen, head_dim) tensors, its scaling, dropout, sliding window and
softcap; attnkit's layout is (batch, seqlen, heads, head_dim) with bottom-right causal, the convention of
HF's flash-attention path, whose mask function attnkit shares: the model hands over HF's 2D padding mask
(or None), never a dense 4D mask. Padded batches and packed sequences (position ids restarting at 0, or
the cu_seq_lens_* kwargs of DataCollatorWithFlattening) go to attnkit's varlen path; the token indices are
worked out once per mask and step, not once per layer. Under torch.compile every batch compiles into one graph
(fullgraph): the token indices of a padding mask are host data, so in a graph a padded batch is packed on the device
with static shapes (`padded_segments`: each row's tokens, then its padding, as two sequences), and queries against
a longer cache get the padding as a key bias built on the device; DataCollatorWithFlattening's
cu_seq_lens go to the varlen path as device tensors (FlashAttention-4 records it through attnkit's ops).
Packing found only from restarting position ids needs their host values: outside graphs only. What the adapter cannot serve (attention sinks,
position biases, a custom 4D mask) fails with one error naming the way out.
"""

from __future__ import annotations

import weakref
from typing import Any

NAME = "attnkit"
_UNSUPPORTED = {
    "s_aux": "attention sinks (s_aux)",
    "position_bias": "a position bias (T5-style)",
}


class UnsupportedCall(ValueError):
    """A call HF makes that attn_implementation='attnkit' cannot serve."""


def _refuse(what: str) -> UnsupportedCall:
    return UnsupportedCall(f"attn_implementation='attnkit' does not support {what}; load the model with "
                           "attn_implementation='sdpa' or 'eager' for it")


# One slot per source of token indices: every layer of a step passes the same mask / position_ids tensor.
_SLOTS: dict[str, tuple[Any, ...]] = {}


def _cached(kind: str, source: Any, extra: tuple[Any, ...], build: Any) -> Any:
    slot = _SLOTS.get(kind)
    if slot is not None and slot[0]() is source and slot[1] == (source._version, *extra):
        return slot[2]
    value = build()
    _SLOTS[kind] = (weakref.ref(source), (source._version, *extra), value)
    return value


def _from_padding_mask(mask: Any, sq: int, sk: int) -> tuple[Any, Any, Any, int, Any, Any, int]:
    """(same, indices_q, cu_q, max_q, indices_k, cu_k, max_k) from HF's 2D mask (batch, >= sk), 1 = token.
    Queries are the last sq positions of the keys (HF's convention for a prompt against a cache)."""
    from attnkit.runtime.layout import mask_indices

    keep_k = mask[:, -sk:].bool()
    keep_q = keep_k[:, -sq:]
    idx_k, cu_k, max_k = mask_indices(keep_k)
    if sq == sk:
        return True, idx_k, cu_k, max_k, idx_k, cu_k, max_k
    idx_q, cu_q, max_q = mask_indices(keep_q)
    return False, idx_q, cu_q, max_q, idx_k, cu_k, max_k


def _from_position_ids(position_ids: Any) -> tuple[Any, int] | None:
    """(cu_seqlens, max_seqlen) of sequences packed into one row (positions restart at 0), or None when the
    row is one sequence."""
    import torch

    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0, as_tuple=False).flatten()
    if starts.numel() <= 1 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None  # one sequence (or a continuation without a restart)
    if int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_full((1,), pos.numel())]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """HF's attention-function signature: (B, H, S, D) in, ((B, S, H, Dv), None) out."""
    import torch

    from attnkit.runtime.attention import attention

    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise _refuse(what)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise _refuse(f"a {attention_mask.dim()}D attention mask (attnkit takes HF's 2D padding mask, which "
                      "its mask function gives; a custom mask needs a mask-based kernel)")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    batch, sq, heads = q.shape[0], q.shape[1], q.shape[2]
    sk = k.shape[1]
    opts: dict[str, Any] = dict(causal=causal, softmax_scale=scaling, dropout_p=float(dropout),
                                softcap=float(softcap or 0.0))
    if sliding_window is not None and sliding_window > 0:
        opts["window"] = (sliding_window - 1, sliding_window - 1)  # HF's flash convention; causal keeps the left

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and batch == 1:  # DataCollatorWithFlattening's kwargs
        if _compiling():  # device tensors as they are: nothing cached on the host inside a graph
            cq, ck = cu_q.to(dtype=_int32()), cu_k.to(dtype=_int32())
        else:
            cq, ck = (_cached(kind, cu, (), lambda cu=cu: cu.to(dtype=_int32(), copy=cu.dtype != _int32()))
                      for kind, cu in (("cu_q", cu_q), ("cu_k", cu_k)))
        out = attention(q[0], k[0], v[0], cu_seqlens_q=cq, cu_seqlens_k=ck,
                        max_seqlen_q=int(kwargs.get("max_length_q") or sq),
                        max_seqlen_k=int(kwargs.get("max_length_k") or sk), **opts)
        return out.unsqueeze(0), None
    if attention_mask is not None and _compiling() and sq == sk and _varlen_records(q, k, v, opts):
        # in a graph the token indices would be host data (a graph break): the batch is packed on the device
        # instead, with static shapes (padded_segments), and runs the varlen path like the eager one
        perm, cu = padded_segments(attention_mask, sk)
        flat = [t.reshape(batch * sq, *t.shape[2:]).index_select(0, perm) for t in (q, k, v)]
        out = attention(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=sq, max_seqlen_k=sk, **opts)
        return torch.empty_like(out).index_copy(0, perm, out).view(batch, sq, heads, out.shape[-1]), None
    if attention_mask is not None and _compiling():
        # queries against a longer cache: the padding becomes a key bias built on the device, exact for every
        # real token (a row of padding only, left of a left-padded sequence, sees padding only: finite values
        # that no real token reads, as HF's own sdpa path gives)
        return attention(q, k, v, attn_bias=_padding_bias(attention_mask, sk), **opts), None
    if attention_mask is not None:
        same, iq, cq, mq, ik, ck, mk = _cached("mask", attention_mask, (sq, sk),
                                                lambda: _from_padding_mask(attention_mask, sq, sk))
        qp = q.reshape(batch * sq, *q.shape[2:]).index_select(0, iq)
        kp = k.reshape(batch * sk, *k.shape[2:]).index_select(0, ik)
        vp = v.reshape(batch * sk, *v.shape[2:]).index_select(0, ik)
        out = attention(qp, kp, vp, cu_seqlens_q=cq, cu_seqlens_k=ck if not same else cq, max_seqlen_q=mq,
                        max_seqlen_k=mk, **opts)
        padded = out.new_zeros(batch * sq, heads, out.shape[-1]).index_copy(0, iq, out)
        return padded.view(batch, sq, heads, out.shape[-1]), None
    position_ids = kwargs.get("position_ids")
    # packing found from position ids reads them on the host: never inside a compiled graph
    if position_ids is not None and batch == 1 and sq == sk and sq > 1 and not _compiling():
        packed = _cached("positions", position_ids, (), lambda: _from_position_ids(position_ids))
        if packed is not None:
            cu, longest = packed
            out = attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                            max_seqlen_k=longest, **opts)
            return out.unsqueeze(0), None
    return attention(q, k, v, **opts), None


def padded_segments(mask: Any, s: int) -> tuple[Any, Any]:
    """A padded batch (HF's 2D mask, batch x >= s, 1 = token) as a packed one, on the device and with static
    shapes, so a compiled graph needs no host data: `perm` gathers the flattened (batch * s) rows so that each
    row's tokens come first, in order, then its padding (left or right); `cu` (int32, 2 * batch + 1) makes every
    row two sequences, its tokens and its padding. Every real token then sees exactly its own row's tokens (the
    padding is a sequence of its own that no token reads, and a row without padding adds an empty one), and the
    static bound s is each sequence's max length."""
    import torch

    keep = mask[:, -s:].bool()
    batch = keep.shape[0]
    order = torch.argsort((~keep).to(torch.int32), dim=1, stable=True)
    perm = (order + torch.arange(batch, device=keep.device)[:, None] * s).reshape(-1)
    tokens = keep.sum(-1, dtype=torch.int32)
    lengths = torch.stack([tokens, s - tokens], dim=1).reshape(-1)
    return perm, torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


PAD = -1e30  # a finite "never": a row of padding only stays finite (no NaN forward or backward), in fp16 too


def _padding_bias(mask: Any, sk: int) -> Any:
    """HF's 2D padding mask (batch, >= sk) as an additive key bias (batch, 1, 1, sk), float32, on the device."""
    import torch

    keep = mask[:, -sk:].bool()
    return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill(~keep, PAD)[:, None, None, :]


def _varlen_records(q: Any, k: Any, v: Any, opts: dict[str, Any]) -> bool:
    """Whether this graph can record the packed call (graph.records_varlen); if not, the key bias serves it."""
    import torch

    from attnkit.runtime.call import _dtype_name
    from attnkit.runtime.graph import constant_window, records_varlen

    window = constant_window(opts.get("window"))  # plain ints (a SymInt is specialised, as attention() does)
    return records_varlen(q.device.type, q.device.index or 0, _dtype_name(q), int(q.shape[2]), int(k.shape[2]),
                          int(q.shape[3]), int(v.shape[3]), bool(opts["causal"]),
                          None if window == (-1, -1) else window, bool(opts["softcap"]), bool(opts["dropout_p"]),
                          torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
                          torch.are_deterministic_algorithms_enabled())


def _compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def _int32() -> Any:
    import torch

    return torch.int32


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """The model's mask for "attnkit": HF's flash-attention mask (None, or the 2D padding mask). In a graph,
    the 2D mask as it is: HF drops an all-ones mask with `mask.all()`, a data-dependent branch that breaks the
    graph; kept, it costs a key bias of zeros (what HF's own compiled sdpa path does with any mask)."""
    import inspect

    from transformers.masking_utils import flash_attention_mask

    if not _compiling():
        return flash_attention_mask(*args, **kwargs)
    bound = inspect.signature(flash_attention_mask).bind(*args, **kwargs)
    mask, kv_length = bound.arguments.get("attention_mask"), bound.arguments["kv_length"]
    return None if mask is None else mask[:, -kv_length:]


def register() -> None:
    """Make attn_implementation="attnkit" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)


register()
