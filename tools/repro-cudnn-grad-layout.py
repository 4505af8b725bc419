"""Plain-torch reproduction (no attnkit): torch's cuDNN attention backward returns wrong dq/dk/dv when the
output gradient's memory layout differs from the output's.

q/k/v are (B, S, H, D) tensors seen as (B, H, S, D) through a transpose (the layout of every caller that keeps
heads inside the sequence dimension: flash-attn's, HF's, attnkit's). The output then has that layout too. The
same call is differentiated with dO laid out like the output, and with dO contiguous (B, H, S, D), each order on
sizes nothing ran before; with a float bias, a boolean mask, and no mask. Errors are max |grad - float64 math|.
Usage: python3 tools/repro-cudnn-grad-layout.py OUT.json
"""
import json, sys, time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev, dt = "cuda", torch.bfloat16
B, H, D = 4, 6, 64
res = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
       "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": []}


def tensors(sq, sk, mask_kind, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v = (torch.randn(B, s, H, D, device=dev, dtype=dt, generator=g).transpose(1, 2) for s in (sq, sk, sk))
    go = torch.randn(B, H, sq, D, device=dev, dtype=dt, generator=g)
    m = None
    if mask_kind == "float_bias":
        m = torch.randn(B, H, sq, sk, device=dev, generator=g).to(dt)
    elif mask_kind == "bool_mask":
        m = (torch.arange(sk, device=dev)[None, :] < torch.randint(sk // 2, sk + 1, (B,), device=dev, generator=g)[:, None])
        m = m[:, None, None, :].expand(B, 1, sq, sk)
    return q, k, v, m, go


def grads(q, k, v, m, go, kernel, work):
    qq, kk, vv = (t.detach().to(work).requires_grad_(True) for t in (q, k, v))
    mm = m.to(work) if m is not None and m.dtype != torch.bool else m
    with sdpa_kernel([kernel]):
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mm)
    return o, torch.autograd.grad(o, (qq, kk, vv), go.to(work))


def err(a, b):
    return round((a.double() - b).abs().max().item(), 4)


size = 300
for mask_kind in ("float_bias", "bool_mask", "no_mask"):
    for order in (("like_out", "contiguous"), ("contiguous", "like_out")):
        size += 7
        q, k, v, m, go = tensors(size, size + 3, mask_kind)
        _, ref = grads(q, k, v, m, go, SDPBackend.MATH, torch.float64)
        row = {"mask": mask_kind, "sizes": [B, H, size, size + 3, D], "order": order}
        for step in order:
            o, _ = grads(q, k, v, m, go, SDPBackend.CUDNN_ATTENTION, dt)
            g_in = go.contiguous() if step == "contiguous" else torch.empty_like(o).copy_(go)
            _, got = grads(q, k, v, m, g_in, SDPBackend.CUDNN_ATTENTION, dt)
            row[step] = {"dO_stride": list(g_in.stride()), "out_stride": list(o.stride()),
                         **{f"d{n}": err(a, r) for n, a, r in zip("qkv", got, ref)}}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
