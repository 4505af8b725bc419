"""Plain-torch check (no attnkit): SDPA's gradients under torch.compile against eager and float64 math, for the
call the H200 smoke found wrong (attnkit-compiled causal_sq_lt_sk: dq/dk/dv errors 1.5-1.8 under
backend="aot_eager", the forward right): bottom-right causal Sq40 Sk96 as a boolean mask built in the graph,
(B, S, H, D) tensors seen through a transpose, dO contiguous (B, S, H, D). Per kernel (torch's pick, cuDNN,
efficient, math) and per compiler (eager, aot_eager, inductor), and with dO re-laid-out like the output inside
the graph (an autograd.Function: the fix in runtime/backends/_sdpa.py).
Usage: python3 tools/repro-compiled-sdpa-grad.py OUT.json
"""
import json, sys, time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
B, H, D, SQ, SK = 2, 4, 64, 40, 96
res = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
       "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shape": [B, SQ, SK, H, D], "rows": []}


class LikeOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out):
        ctx.stride = out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return g if g.stride() == ctx.stride else g.new_empty_strided(g.shape, ctx.stride).copy_(g)


def f(q, k, v, relayout):
    i = torch.arange(q.shape[1], device=q.device)[:, None]
    j = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = j <= i + (k.shape[1] - q.shape[1])
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    if relayout:
        o = LikeOut.apply(o)
    return o.transpose(1, 2)


g = torch.Generator(device=dev).manual_seed(0)
base = [torch.randn(B, s, H, D, device=dev, generator=g) for s in (SQ, SK, SK)]
go = torch.randn(B, SQ, H, D, device=dev, generator=g)
q64, k64, v64 = (t.double().requires_grad_(True) for t in base)
ref = torch.autograd.grad(f(q64, k64, v64, False), (q64, k64, v64), go.double())
kernels = {"pick": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "math": SDPBackend.MATH}
for dt in (torch.bfloat16, torch.float16):
    for kname, kern in kernels.items():
        for comp in ("eager", "aot_eager", "inductor"):
            if comp == "inductor" and (dt is not torch.bfloat16 or kname not in ("pick", "cudnn")):
                continue  # inductor compiles take seconds each: the two kernels a graph picks, in one dtype
            for relayout in (False, True):
                row = {"dtype": str(dt).split(".")[-1], "kernel": kname, "compiler": comp, "relayout": relayout}
                try:
                    torch._dynamo.reset()
                    fn = (lambda *a: f(*a, relayout)) if comp == "eager" else torch.compile(
                        lambda *a: f(*a, relayout), backend=comp, fullgraph=True)
                    q, k, v = (t.to(dt).requires_grad_(True) for t in base)
                    ctx = sdpa_kernel([kern]) if kern is not None else torch.enable_grad()
                    with ctx:
                        o = fn(q, k, v)
                        gr = torch.autograd.grad(o, (q, k, v), go.to(dt))
                    row.update({f"d{n}": round((a.double() - r).abs().max().item(), 4) for n, a, r in zip("qkv", gr, ref)})
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                res["rows"].append(row)
                print(row, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
