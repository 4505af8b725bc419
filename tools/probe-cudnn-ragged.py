"""Probe: torch's ragged (THD) cuDNN attention, aten._cudnn_attention_forward/_backward with cumulative
sequence offsets, forward+backward against a float64 reference. Run on a GPU machine:
    PYTHONPATH=src python3 tools/probe-cudnn-ragged.py
Result on the H200 (torch 2.11.0+cu130, cuDNN 9.19, 2026-11-30): docs/results/2026-11-30-h200-cudnn-ragged-probe.txt
(wrong gradients at head_dim 64, then illegal memory accesses): why attnkit has no backend on this route.
"""
import functools
import math

import torch

from attnkit.runtime.reference import reference_attention


@functools.cache
def _autograd_fn():
    aten = torch.ops.aten

    class _Ragged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int,
                    causal: bool, scale: float):
            res = aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal,
                                                False, scale=scale)
            out, lse, seed, offset = res[0], res[1], res[6], res[7]
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
            ctx.args = (max_q, max_k, causal, scale)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
            max_q, max_k, causal, scale = ctx.args
            dq, dk, dv = aten._cudnn_attention_backward(grad.contiguous(), q, k, v, out, lse, seed, offset, None,
                                                        cu_q, cu_k, max_q, max_k, 0.0, causal, scale=scale)
            return dq, dk, dv, None, None, None, None, None, None

    return _Ragged


print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
print("ops", hasattr(torch.ops.aten, "_cudnn_attention_forward"), hasattr(torch.ops.aten, "_cudnn_attention_backward"))
try:
    print(torch.ops.aten._cudnn_attention_backward.default._schema)
except Exception as e:
    print("no schema", e)
F = _autograd_fn()
for d in (64, 128, 256):
    for lens in ([33, 1, 70, 0, 17], [300, 129, 1000, 5], [4096, 2000, 1000]):
        for causal in (True, False):
            try:
                g = torch.Generator().manual_seed(0)
                T, H = sum(lens), 4
                q, k, v = (torch.randn(T, H, d, generator=g).cuda().bfloat16().requires_grad_(True) for _ in range(3))
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                o = F.apply(q, k, v, cu, cu, max(lens), max(lens), causal, 1 / math.sqrt(d))
                q6, k6, v6 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
                r = reference_attention(q6, k6, v6, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
                gr = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).cuda()
                ga = torch.autograd.grad(o, (q, k, v), gr.bfloat16())
                gb = torch.autograd.grad(r, (q6, k6, v6), gr.double())
                errs = [(o.double() - r).abs().max().item()] + [(a.double() - b).abs().max().item() for a, b in zip(ga, gb, strict=True)]
                print(f"d={d} lens={lens} causal={causal}: max err fwd {errs[0]:.3g} dq {errs[1]:.3g} dk {errs[2]:.3g} dv {errs[3]:.3g}")
            except Exception as e:
                print(f"d={d} lens={lens} causal={causal}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
