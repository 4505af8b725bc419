"""The cuDNN output-gradient layout fix (issue 21): torch 2.11's cuDNN attention backward returned wrong gradients
when dO's strides differed from the output's (docs/cudnn-grad-layout.md). attnkit hands that kernel a dO laid out
like its output; on CPU this is checked with a stand-in op that records the layout its backward receives."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attnkit.runtime.backends._sdpa import cudnn_backward_possible, grad_like_output  # noqa: E402
from attnkit.runtime.call import Inputs  # noqa: E402
from attnkit.runtime.smoke import _other_layout  # noqa: E402

SEEN: list[tuple[int, ...]] = []
POINTERS: list[int] = []


class _Kernel(torch.autograd.Function):
    """Identity whose backward records the strides of the gradient it is handed (as cuDNN's backward sees dO)."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x.clone(memory_format=torch.preserve_format)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        SEEN.append(tuple(g.stride()))
        POINTERS.append(g.data_ptr())
        return g


def _out(bshd: bool = True) -> tuple[Any, Any]:
    """(B, H, S, D) view of a (B, S, H, D) buffer (attnkit's layout), or a contiguous (B, H, S, D) one."""
    x = torch.randn(2, 5, 3, 4).transpose(1, 2) if bshd else torch.randn(2, 3, 5, 4)
    x.requires_grad_(True)
    return x, _Kernel.apply(x)


def test_the_kernel_sees_a_gradient_laid_out_like_its_output() -> None:
    SEEN.clear()
    x, out = _out()
    g = torch.randn(out.shape)  # contiguous (B, H, S, D): not the output's layout
    (gx,) = torch.autograd.grad(out, x, g)
    assert SEEN[-1] != tuple(out.stride())  # negative control: without the fix the layouts differ
    x, out = _out()
    guarded = grad_like_output(out)
    (gx2,) = torch.autograd.grad(guarded, x, g)
    assert SEEN[-1] == tuple(out.stride())
    assert torch.equal(gx, gx2)  # the values are untouched


def test_a_gradient_already_laid_out_like_the_output_is_not_copied() -> None:
    for bshd in (True, False):
        x, out = _out(bshd)
        g = torch.empty_like(out).copy_(torch.randn(out.shape))
        guarded = grad_like_output(out)
        SEEN.clear()
        POINTERS.clear()
        torch.autograd.grad(guarded, x, g)
        assert SEEN[-1] == tuple(out.stride())
        assert POINTERS[-1] == g.data_ptr()  # the very tensor: no copy


def _grads(out: Any) -> dict[str, Any]:
    """Output gradients in the layouts a backward hands over: like the output, contiguous, another transpose, a
    slice of a wider buffer, a gradient expanded from a scalar (`out.sum().backward()`)."""
    shape = out.shape
    return {"like": torch.empty_like(out).copy_(torch.randn(shape)),
            "contiguous": torch.randn(shape),
            "BSDH": torch.randn(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2),
            "slice": torch.randn(*shape[:-1], 2 * shape[-1])[..., : shape[-1]],
            "expanded": torch.ones(()).expand(shape)}


@pytest.mark.parametrize("bshd", [True, False])
def test_the_relayout_holds_for_every_gradient_layout(bshd: bool) -> None:
    """Whatever the layout of dO (an expanded one included), the kernel gets it laid out like its output, with
    the gradient's values."""
    for name, g in _grads(_out(bshd)[1]).items():
        x, out = _out(bshd)
        guarded = grad_like_output(out)
        SEEN.clear()
        (gx,) = torch.autograd.grad(guarded, x, g)
        assert torch.equal(gx, g), name
        assert SEEN[-1] == tuple(out.stride()), (name, SEEN)


def test_which_calls_get_the_fix() -> None:
    def call(**kw: Any) -> Any:
        q = torch.randn(1, 8, 2, 16, requires_grad=kw.pop("grad", True))
        return Inputs(q, q, q, **kw).describe()

    train = call()
    cuda_train = train.__class__(**{**train.__dict__, "device": "cuda"})
    assert cudnn_backward_possible(cuda_train, None) and cudnn_backward_possible(cuda_train, "CUDNN_ATTENTION")
    assert not cudnn_backward_possible(cuda_train, "EFFICIENT_ATTENTION")
    assert not cudnn_backward_possible(train, None)  # CPU: no cuDNN
    infer = call(grad=False)
    assert not cudnn_backward_possible(infer.__class__(**{**infer.__dict__, "device": "cuda"}), None)
    traced = cuda_train.__class__(**{**cuda_train.__dict__, "trace": "compile"})
    assert cudnn_backward_possible(traced, None)  # in a graph torch's pick is made at trace time: cuDNN too


def test_in_a_graph_the_relayout_is_recorded() -> None:
    """The traced form of the fix (an autograd.Function): compiled with fullgraph, the gradient reaching the
    op arrives laid out like its output, and the values are unchanged."""
    from attnkit.runtime.backends._sdpa_graph import LikeOutput

    seen: list[tuple[int, ...]] = []

    # the "kernel": opaque ops (as SDPA's are to a graph) whose backward records the gradient's strides
    @torch.library.custom_op("attnkit_test::kernel", mutates_args=())
    def kernel(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).contiguous()  # its output: contiguous (B, H, S, D)

    @kernel.register_fake
    def _(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).contiguous()

    @torch.library.custom_op("attnkit_test::kernel_bwd", mutates_args=())
    def kernel_bwd(g: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(g.stride()))
        return g.transpose(1, 2).clone(memory_format=torch.contiguous_format)

    @kernel_bwd.register_fake
    def _(g: torch.Tensor) -> torch.Tensor:
        return g.transpose(1, 2).contiguous()

    kernel.register_autograd(lambda ctx, g: kernel_bwd(g))

    x = torch.randn(2, 5, 3, 4, requires_grad=True)  # (B, S, H, D)

    def f(x: Any) -> Any:
        return LikeOutput.apply(kernel(x)).transpose(1, 2)

    def unguarded(x: Any) -> Any:
        return kernel(x).transpose(1, 2)

    g = torch.randn(2, 5, 3, 4)  # dO contiguous in (B, S, H, D): another layout than the output's
    eager = torch.autograd.grad(f(x), x, g)[0]
    want = tuple(x.transpose(1, 2).contiguous().stride())
    assert seen[-1] == want
    # in a graph with symbolic sizes, AOTAutograd does not force the gradient's strides itself (with static
    # sizes it guesses them from the output): there the relayout is what the kernel's backward relies on
    for fn, expect_want in ((unguarded, False), (f, True)):
        seen.clear()
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
        got = torch.autograd.grad(compiled(x), x, g)[0]
        assert seen and (seen[-1] == want) is expect_want, (fn.__name__, seen)
        assert torch.equal(got, eager)


def test_smoke_checks_a_second_gradient_layout() -> None:
    for t in (torch.randn(2, 7, 3, 4), torch.randn(9, 3, 4)):
        o = _other_layout(t)
        assert torch.equal(o, t) and o.stride() != t.stride()
