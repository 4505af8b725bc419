"""Why was the first cudnn_ragged backend slower than expected? cuDNN's fused attention on the bench's packed
varlen shape (16 sequences <= 4096 tokens, 44% padding, 16 heads, D128, bf16, causal), built through
cudnn-frontend graphs in several variants and timed side by side against SDPA's cuDNN on the padded batch.

Run on the GPU machine (cudnn-frontend installed, attnkit on PYTHONPATH):
    python3 tools/probe-cudnn-ragged-variants.py OUT.json
Result on the H200 (docs/results/2026-11-30-h200-cudnn-ragged-explore.json): the bottom-right causal
alignment makes cuDNN's backward 4.4 ms vs 2.5 ms top-left for the same mask (equal q/k lengths), so
cudnn_ragged uses top-left whenever every sequence has as many queries as keys; the ragged kernel at full
lengths is as fast as SDPA's padded one. (That report also has a forward-only "ragged_br_infer" row from the
first version of this script.)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnkit.runtime.backends import cudnn_ragged as cr
from attnkit.bench.timer import warm_gpu

B, S, H, D = 16, 4096, 16, 128
DEV = torch.device("cuda:0")
SCALE = D ** -0.5


def timeit(fn: Any, n: int = 20) -> float:
    """Median milliseconds of `fn` over n runs (CUDA events), after 3 warm-up runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def build(b: int, ragged: bool, causal: str, which: str) -> tuple[Any, dict[str, Any]]:
    """One forward (training) or backward graph; returns it and its tensors by name."""
    cudnn = cr._cudnn()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=cr._handle(0))
    i32 = cudnn.data_type.INT32
    t: dict[str, Any] = {n: g.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
                         for n in ("lq", "lk")}
    if ragged:
        t["off"] = g.tensor(name="off", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    dims, strides = [b, H, S, D], [S * H * D, D, H * D, 1]

    def bhsd(name: str) -> Any:
        return g.tensor(name=name, dim=dims, stride=strides, **({"ragged_offset": t["off"]} if ragged else {}))

    def output(x: Any) -> Any:
        x.set_output(True).set_dim(dims).set_stride(strides)
        if ragged:
            x.set_ragged_offset(t["off"])
        return x

    mask: dict[str, Any] = {"attn_scale": SCALE, "use_padding_mask": True, "seq_len_q": t["lq"], "seq_len_kv": t["lk"]}
    if causal in ("br", "tl"):
        align = cudnn.diagonal_alignment.BOTTOM_RIGHT if causal == "br" else cudnn.diagonal_alignment.TOP_LEFT
        mask.update(diagonal_alignment=align, diagonal_band_right_bound=0)
    else:  # "tl_flag": the older use_causal_mask switch
        mask["use_causal_mask"] = True
    names = ("q", "k", "v") if which == "fwd" else ("q", "k", "v", "o", "do")
    t.update({n: bhsd(n) for n in names})
    stats = ([b, H, S, 1], [H * S, S, 1, 1])
    if which == "fwd":
        o, st = g.sdpa(name="fwd", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, **mask)
        t["o"] = output(o)
        st.set_output(True).set_dim(stats[0]).set_stride(stats[1]).set_data_type(cudnn.data_type.FLOAT)
        t["st"] = st
    else:
        t["st"] = g.tensor(name="st", dim=stats[0], stride=stats[1], data_type=cudnn.data_type.FLOAT)
        grads = g.sdpa_backward(name="bwd", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["st"], **mask)
        t.update({n: output(x) for n, x in zip(("dq", "dk", "dv"), grads, strict=True)})
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return g, t


def variant(lengths: list[int], ragged: bool, causal: str) -> dict[str, float]:
    """Forward and backward milliseconds of one variant."""
    b = len(lengths)
    tokens = sum(lengths) if ragged else b * S
    data = {n: torch.randn(tokens, H, D, device=DEV, dtype=torch.bfloat16) for n in ("q", "k", "v", "o", "do")}
    data.update({n: torch.empty(tokens, H, D, device=DEV, dtype=torch.bfloat16) for n in ("dq", "dk", "dv")})
    data["st"] = torch.empty(b, H, S, 1, device=DEV, dtype=torch.float32)
    data["lq"] = data["lk"] = torch.tensor(lengths, dtype=torch.int32, device=DEV).view(-1, 1, 1, 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    data["off"] = cu * (H * D)
    handle = cr._handle(0)
    cr._cudnn().set_stream(handle, torch.cuda.current_stream().cuda_stream)
    res = {}
    for which in ("fwd", "bwd"):
        g, t = build(b, ragged, causal, which)
        ws = torch.empty(g.get_workspace_size(), device=DEV, dtype=torch.uint8)
        pack = {x: data[n] for n, x in t.items()}
        res[f"{which}_ms"] = timeit(lambda g=g, pack=pack, ws=ws: g.execute(pack, ws, handle=handle))
    return res


def sdpa_padded() -> dict[str, float]:
    """SDPA's cuDNN kernel on the padded (B, S) batch: what the packed variants are compared with."""
    x = [torch.randn(B, S, H, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    qt, kt, vt = (t.transpose(1, 2) for t in x)

    def fwd() -> Any:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    grad = torch.randn_like(fwd())
    return {"fwd_ms": timeit(fwd), "fwdbwd_ms": timeit(lambda: fwd().backward(grad))}


def main() -> None:
    gen = torch.Generator().manual_seed(0)  # the bench's lengths (the bench of 2026-11-30)
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    lengths[0] = S
    lens = lengths.tolist()
    warm_gpu()
    out: dict[str, Any] = {"lengths": lens, "flop_ratio": sum(n * n for n in lens) / (B * S * S),
                           "sdpa_padded": sdpa_padded()}
    for name, args in [("ragged_br", (lens, True, "br")), ("ragged_tl", (lens, True, "tl")),
                       ("ragged_tlflag", (lens, True, "tl_flag")), ("padmask_tlflag", (lens, False, "tl_flag")),
                       ("padmask_br", (lens, False, "br")), ("ragged_full_tlflag", ([S] * B, True, "tl_flag")),
                       ("padmask_full_tlflag", ([S] * B, False, "tl_flag"))]:
        try:
            out[name] = variant(*args)
        except Exception as exc:  # a variant cuDNN cannot build is a result too
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, out[name], flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # which cuDNN kernels run, padded vs ragged
        variant(lens, True, "br")
        sdpa_padded()
    out["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=110)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
