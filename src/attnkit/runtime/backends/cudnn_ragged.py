"""Packed varlen attention on cuDNN's own ragged (THD) layout, through the cudnn-frontend Python graphs
(`nvidia-cudnn-frontend`, module `cudnn`).

Why: cuDNN is the fastest attention kernel on Hopper (~1.8x FlashAttention-2,
docs/results/2026-11-30-h200-bench-flash-attn.json), and with
ragged offsets plus a padding mask it reads the packed (total, heads, head_dim) tensors in place and skips
every tile past a sequence's end: no copies, no padded work. torch's own route to the same kernel
(aten._cudnn_attention_forward/backward with cu_seqlens) gave wrong gradients on torch 2.11
(docs/results/2026-11-30-h200-cudnn-ragged-probe.txt); this backend builds the graphs itself.

Graphs are built once per (device, dtype, batch, heads, head dims, max seqlen rounded up to a power of two,
causal, scale) and cached; the per-call cost is two tiny device ops (offsets, lengths) and the launches.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any

from attnkit.runtime.backends.base import Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params

GRAPH_CACHE_SIZE = 64
MIN_CUDNN = 90500  # ragged offsets + padding mask + bottom-right causal, fwd and bwd, on Hopper
_LOCK = threading.Lock()
_GRAPHS: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def round_seqlen(n: int) -> int:
    """The declared max seqlen of a graph: a power of two >= 64, so batches of similar lengths share a graph
    (the padding mask bounds the real work, so a larger declared max costs nothing but empty tiles)."""
    return max(64, 1 << max(0, (n - 1).bit_length()))


@functools.cache
def _cudnn() -> Any:
    import cudnn

    return cudnn


@functools.cache
def _handle(device_index: int) -> Any:
    import torch

    with torch.cuda.device(device_index):
        return _cudnn().create_handle()


class _Shape:
    """Everything a graph is specialised on."""

    def __init__(self, call: AttentionCall, scale: float) -> None:
        self.b = call.batch
        self.h, self.hk = call.heads, call.kv_heads
        self.d, self.dv = call.head_dim, call.head_dim_v
        self.sq, self.sk = round_seqlen(call.seqlen_q), round_seqlen(call.seqlen_k)
        self.causal, self.scale, self.train = call.causal, scale, call.requires_grad
        # Self-attention varlen: top-left == bottom-right per sequence, and cuDNN's top-left backward measured
        # 1.8x faster than its bottom-right one on the H200 (2.5 vs 4.4 ms, docs/results/*-cudnn-ragged-explore.json)
        self.bottom_right = call.causal and not call.varlen_same
        self.dtype = call.dtype  # "float16" | "bfloat16"
        self.device = call.device_index
        self.deterministic = call.deterministic

    def key(self, which: str) -> tuple[Any, ...]:
        return (which, self.device, self.dtype, self.b, self.h, self.hk, self.d, self.dv, self.sq, self.sk,
                self.causal, self.bottom_right, self.scale, self.train, self.deterministic)


def _declare(g: Any, name: str, b: int, h: int, s: int, d: int, offset: Any) -> Any:
    """A packed (total, h, d) tensor seen by cuDNN as (b, h, s, d) with per-sequence ragged offsets."""
    return g.tensor(name=name, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1], ragged_offset=offset)


def _common(g: Any, s: _Shape) -> tuple[dict[str, Any], dict[str, Any]]:
    """Graph inputs every graph has (offsets, lengths) and the sdpa mask arguments."""
    cudnn = _cudnn()
    i32 = cudnn.data_type.INT32
    io = {n: g.tensor(name=n, dim=[s.b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
          for n in ("off_q", "off_k", "off_v", "off_o")}
    io.update({n: g.tensor(name=n, dim=[s.b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
               for n in ("len_q", "len_k")})
    mask: dict[str, Any] = {"attn_scale": s.scale, "use_padding_mask": True, "seq_len_q": io["len_q"],
                            "seq_len_kv": io["len_k"]}
    if s.causal:  # attnkit's one causal convention is bottom-right; top-left is the same when lengths match
        align = cudnn.diagonal_alignment.BOTTOM_RIGHT if s.bottom_right else cudnn.diagonal_alignment.TOP_LEFT
        mask.update(diagonal_alignment=align, diagonal_band_right_bound=0)
    return io, mask


def _graph(s: _Shape, which: str) -> tuple[Any, dict[str, Any], int]:
    key = s.key(which)
    with _LOCK:
        hit = _GRAPHS.get(key)
        if hit is not None:
            _GRAPHS.move_to_end(key)
            return hit
    cudnn = _cudnn()
    dt = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}[s.dtype]
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle(s.device))
    io, mask = _common(g, s)
    io["q"] = _declare(g, "q", s.b, s.h, s.sq, s.d, io["off_q"])
    io["k"] = _declare(g, "k", s.b, s.hk, s.sk, s.d, io["off_k"])
    io["v"] = _declare(g, "v", s.b, s.hk, s.sk, s.dv, io["off_v"])
    stats_dim, stats_stride = [s.b, s.h, s.sq, 1], [s.h * s.sq, s.sq, 1, 1]
    if which == "fwd":
        o, stats = g.sdpa(name="sdpa", q=io["q"], k=io["k"], v=io["v"], generate_stats=s.train, **mask)
        o.set_output(True).set_dim([s.b, s.h, s.sq, s.dv]).set_stride(
            [s.sq * s.h * s.dv, s.dv, s.h * s.dv, 1]).set_ragged_offset(io["off_o"])
        io["o"] = o
        if s.train:
            stats.set_output(True).set_dim(stats_dim).set_stride(stats_stride).set_data_type(cudnn.data_type.FLOAT)
            io["stats"] = stats
    else:
        io["o"] = _declare(g, "o", s.b, s.h, s.sq, s.dv, io["off_o"])
        io["do"] = _declare(g, "do", s.b, s.h, s.sq, s.dv, io["off_o"])
        io["stats"] = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=cudnn.data_type.FLOAT)
        grads = g.sdpa_backward(name="sdpa_bwd", q=io["q"], k=io["k"], v=io["v"], o=io["o"], dO=io["do"],
                                stats=io["stats"], use_deterministic_algorithm=s.deterministic, **mask)
        for name, t, like in zip(("dq", "dk", "dv"), grads, ("q", "k", "v"), strict=True):
            t.set_output(True).set_dim(io[like].get_dim()).set_stride(io[like].get_stride()).set_ragged_offset(
                io["off_" + like])
            io[name] = t
    try:
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    except Exception as exc:  # a RuntimeError, so attention() falls back to the next backend and remembers it
        raise RuntimeError(f"cudnn_ragged: cuDNN has no plan for this {which} graph: {exc}") from exc
    entry = (g, io, int(g.get_workspace_size()))
    with _LOCK:
        _GRAPHS[key] = entry
        while len(_GRAPHS) > GRAPH_CACHE_SIZE:
            _GRAPHS.popitem(last=False)
    return entry


def _execute(s: _Shape, which: str, data: dict[str, Any]) -> None:
    import torch

    g, io, ws = _graph(s, which)
    handle = _handle(s.device)
    _cudnn().set_stream(handle, torch.cuda.current_stream(s.device).cuda_stream)
    workspace = torch.empty(ws, device=f"cuda:{s.device}", dtype=torch.uint8)
    g.execute({io[n]: t for n, t in data.items()}, workspace, handle=handle)


def _meta(cu_q: Any, cu_k: Any, s: _Shape) -> dict[str, Any]:
    """Offsets in elements (cuDNN's ragged unit) and per-sequence lengths, all int32 on the device."""
    off_q, off_k = cu_q * (s.h * s.d), cu_k * (s.hk * s.d)
    same_dv = s.dv == s.d  # then v and o share k's and q's offsets
    return {"off_q": off_q, "off_k": off_k, "off_v": off_k if same_dv else cu_k * (s.hk * s.dv),
            "off_o": off_q if same_dv else cu_q * (s.h * s.dv), "len_q": (cu_q[1:] - cu_q[:-1]).view(-1, 1, 1, 1),
            "len_k": (cu_k[1:] - cu_k[:-1]).view(-1, 1, 1, 1)}


@functools.cache
def _function() -> Any:
    import torch

    class RaggedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, meta: dict[str, Any], s: _Shape) -> Any:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            o = q.new_empty(q.shape[0], s.h, s.dv)
            data = {"q": q, "k": k, "v": v, "o": o, **meta}
            stats = None
            if s.train:
                stats = torch.empty(s.b, s.h, s.sq, 1, device=q.device, dtype=torch.float32)
                data["stats"] = stats
            _execute(s, "fwd", data)
            if s.train:
                ctx.save_for_backward(q, k, v, o, stats)
                ctx.meta, ctx.shape = meta, s
            return o

        @staticmethod
        def backward(ctx: Any, do: Any) -> Any:
            q, k, v, o, stats = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            _execute(ctx.shape, "bwd", {"q": q, "k": k, "v": v, "o": o, "do": do.contiguous(), "stats": stats,
                                        "dq": dq, "dk": dk, "dv": dv, **ctx.meta})
            return dq, dk, dv, None, None

    return RaggedAttention


class CudnnRagged(Backend):
    name = "cudnn_ragged"
    library = "cudnn-frontend"
    limits = Limits(
        min_capability=(9, 0),  # cuDNN's ragged fused attention (THD) needs Hopper or newer
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=128,
        head_dim_multiple=8,
        gqa="native",
        dense=False,
        varlen="native",
        deterministic_backward=True,
    )

    def extra_unavailable(self, probe: Any) -> list[str]:
        have = probe.torch.cudnn
        if not have or have < MIN_CUDNN:
            return [f"needs cuDNN >= {MIN_CUDNN} for ragged attention (torch has {have or 'no cuDNN'})"]
        return []

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        """The graph's shape, the ragged offsets and the keyless rows, once per bound call (its signature holds
        cu_seqlens by identity and version): the runner is the kernel call and, where some rows see no key,
        one index_fill."""
        import torch

        s = _Shape(call, p.scale)
        meta = _meta(p.cu_seqlens_q, p.cu_seqlens_k, s)
        fn = _function()
        # varlen_same: every row sees its own key, nothing to zero
        rows = [] if call.varlen_same else keyless_rows(call.lengths_q or (), call.lengths_k or (), call.causal)
        if not rows:
            return lambda q, k, v: fn.apply(q, k, v, meta, s)
        index = torch.tensor(rows, device=q.device)
        return lambda q, k, v: fn.apply(q, k, v, meta, s).index_fill(0, index, 0.0)


def keyless_rows(lengths_q: tuple[int, ...], lengths_k: tuple[int, ...], causal: bool) -> list[int]:
    """Packed rows that see no key (a sequence with no keys; bottom-right causal with more queries than keys):
    attnkit's contract is zeros there, whatever the kernel leaves."""
    rows: list[int] = []
    start = 0
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        empty = lq if lk == 0 else (max(0, lq - lk) if causal else 0)
        rows.extend(range(start, start + empty))
        start += lq
    return rows
