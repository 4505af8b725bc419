"""_sdpa's cuDNN gradient-layout fix in the form a graph records (imported by bind() only in a traced call).

grad_like_output registers a tensor hook, which dynamo and AOTAutograd do not record; in a graph torch's
kernel pick is made at trace time and may be cuDNN, whose backward goes wrong when dO is laid out unlike the
output (_sdpa.grad_like_output says where that was found). Under torch.compile(backend="aot_eager") the H200
smoke measured dq/dk/dv errors of 1.5-1.8 for bottom-right causal Sq40 Sk96 (a mask built in the graph)
without this; tools/repro-compiled-sdpa-grad.py is the plain-torch check per kernel and compiler.
"""

from __future__ import annotations

from typing import Any

import torch


class LikeOutput(torch.autograd.Function):
    """Identity forward; backward hands on the gradient laid out like the forward's output."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        ctx.stride = out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == ctx.stride:
            return grad
        return grad.new_empty_strided(grad.shape, ctx.stride).copy_(grad)
