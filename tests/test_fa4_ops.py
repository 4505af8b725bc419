"""FlashAttention-4's torch.library ops (runtime/backends/fa4_ops.py) on this CPU machine: the fake
implementations (shapes, dtypes, symbolic sizes, no flash_attn.cute import), torch.library.opcheck against a
CPU reference kernel registered here (FA4's own kernels need a GPU), and the compile path's graph holding both
ops with FA4 selected (a fake H200 probe, fake CUDA tensors)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from test_selection import fake_probe
from torch._subclasses.fake_tensor import FakeTensorMode

from attnkit.runtime.backends import fa4_ops

OPS = fa4_ops.ops()


def _ref(q, k, v, scale, causal):
    """(out, lse) in FA4's layouts, dense (batch, seqlen, heads, d) inputs, float32 math."""
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    s = qt @ kt.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vt).transpose(1, 2).to(q.dtype).contiguous(), lse.contiguous()


bwd_calls: list[bool] = []  # the `deterministic` argument of each reference backward call


@pytest.fixture(scope="module")
def cpu_kernels():
    """A CPU reference for the four ops, registered for this module's tests only (opcheck needs a real kernel).
    Not differentiable, like FA4's kernels: a gradient that reaches q, k, v came through an autograd formula."""

    def fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, wl, wr, cap):
        with torch.no_grad():
            return _ref(q, k, v, scale, causal)

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal, wl, wr, cap, det):
        bwd_calls.append(det)
        with torch.no_grad():
            return _bwd(dout, q, k, v, out, lse, scale, causal)

    def _bwd(dout, q, k, v, out, lse, scale, causal):
        # the attention backward written out
        g = q.shape[2] // k.shape[2]
        qt, kt, vt, dot, ot = (t.transpose(1, 2).double() for t in (q, k, v, dout, out))
        kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
        p = torch.exp(qt @ kt.transpose(-1, -2) * scale - lse.double()[..., None])
        if causal:
            sq, sk = p.shape[-2:]
            p = p * (torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq))
        dv = p.transpose(-1, -2) @ dot
        ds = p * (dot @ vt.transpose(-1, -2) - (dot * ot).sum(-1, keepdim=True))
        dq, dk = ds @ kt * scale, ds.transpose(-1, -2) @ qt * scale

        def fold(t, like):  # sum the query heads of each kv head (GQA), back to (batch, seqlen, heads, d)
            b, h, s_, d = t.shape
            return t.reshape(b, h // g, g, s_, d).sum(2).transpose(1, 2).to(like.dtype).contiguous()
        return dq.transpose(1, 2).to(q.dtype).contiguous(), fold(dk, k), fold(dv, v)

    torch.library.register_kernel("attnkit::fa4_fwd", "cpu", fwd)
    torch.library.register_kernel("attnkit::fa4_fwd_raw", "cpu", fwd)
    torch.library.register_kernel("attnkit::fa4_fwd_infer", "cpu", lambda *a: fwd(*a)[0])
    torch.library.register_kernel("attnkit::fa4_bwd", "cpu", bwd)
    return


def test_fake_shapes_dense_and_varlen_without_importing_flash_attn_cute():
    code = (
        "import sys, torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from attnkit.runtime.backends.fa4_ops import ops\n"
        "o = ops()\n"
        "with FakeTensorMode():\n"
        "    q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device='cuda')\n"
        "    k = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16, device='cuda')\n"
        "    v = torch.empty(2, 300, 2, 32, dtype=torch.bfloat16, device='cuda')\n"
        "    out, lse = o.fa4_fwd(q, k, v, None, None, -1, -1, 0.125, True, -1, -1, 0.0)\n"
        "    assert out.shape == (2, 100, 8, 32) and out.dtype == torch.bfloat16 and out.device.type == 'cuda'\n"
        "    o2 = o.fa4_fwd_infer(q, k, v, None, None, -1, -1, 0.125, True, -1, -1, 0.0)\n"
        "    assert o2.shape == out.shape and o2.dtype == out.dtype and o2.device == out.device\n"
        "    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32\n"
        "    qp = torch.empty(700, 8, 64, dtype=torch.float16, device='cuda')\n"
        "    kp = torch.empty(900, 2, 64, dtype=torch.float16, device='cuda')\n"
        "    cu = torch.empty(5, dtype=torch.int32, device='cuda')\n"
        "    out, lse = o.fa4_fwd(qp, kp, kp, cu, cu, 300, 400, 0.125, False, 128, 0, 0.0)\n"
        "    assert out.shape == (700, 8, 64) and lse.shape == (8, 700)\n"
        "    dq, dk, dv = o.fa4_bwd(out, qp, kp, kp, out, lse, cu, cu, 300, 400, 0.1, False, -1, -1, 0.0, False)\n"
        "    assert dq.shape == qp.shape and dk.shape == kp.shape and dv.shape == kp.shape\n"
        "assert 'flash_attn.cute' not in sys.modules and 'flash_attn' not in sys.modules\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_fake_shapes_stay_symbolic():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v):
        return OPS.fa4_fwd(q, k, v, None, None, -1, -1, 0.125, True, -1, -1, 0.0)

    q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16)
    gm = make_fx(f, tracing_mode="symbolic")(q, k, k)
    shapes = [n.meta["val"] for n in gm.graph.nodes if n.op == "call_function" and "fa4_fwd" in str(n.target)]
    assert shapes, gm.graph
    out, lse = shapes[0]
    assert not isinstance(out.shape[1], int) and str(out.shape[1]) == str(gm.graph.find_nodes(op="placeholder")[0]
                                                                            .meta["val"].shape[1])
    assert lse.shape[2] == out.shape[1] and lse.dtype == torch.float32


def test_opcheck_with_a_cpu_reference_kernel(cpu_kernels):
    """opcheck on the four ops: schema, fake against real kernel, AOT dispatch with static and dynamic shapes, and
    for fa4_fwd, whose inputs require grad here, its autograd registration. The others take inputs without grad:
    they have no autograd kernel by design (fa4_ops says why), which opcheck would report for inputs that do."""
    torch.manual_seed(0)
    for causal, (sq, sk) in ((True, (16, 16)), (False, (8, 24)), (True, (5, 12))):
        q = torch.randn(2, sq, 4, 16)
        k = torch.randn(2, sk, 2, 16)
        v = torch.randn(2, sk, 2, 16)
        args = (None, None, -1, -1, 1 / math.sqrt(16), causal, -1, -1, 0.0)
        grads = tuple(t.clone().requires_grad_() for t in (q, k, v))
        torch.library.opcheck(OPS.fa4_fwd, (*grads, *args))
        torch.library.opcheck(OPS.fa4_fwd_raw, (q, k, v, *args))
        torch.library.opcheck(OPS.fa4_fwd_infer, (q, k, v, *args))
        out, lse = OPS.fa4_fwd_raw(q, k, v, *args)
        torch.library.opcheck(OPS.fa4_bwd, (torch.randn_like(out), q, k, v, out, lse, *args, False))


def test_only_fa4_fwd_has_an_autograd_kernel():
    """A Python kernel at the Autograd key would run on every call of a compiled graph (its forward graph runs
    with grad off, and still enters it): 10-30% of a compiled one-op step's host time on the dev CPU (fa4_ops).
    fa4_fwd keeps one for torch.export and direct callers; what compiled graphs record has none."""
    has = {name: torch._C._dispatch_has_kernel_for_dispatch_key(f"attnkit::{name}", "Autograd")
           for name in ("fa4_fwd", "fa4_fwd_raw", "fa4_bwd", "fa4_fwd_infer")}
    assert has == {"fa4_fwd": True, "fa4_fwd_raw": False, "fa4_bwd": False, "fa4_fwd_infer": False}


def test_autograd_through_the_fa4_fwd_op_gives_the_reference_gradient(cpu_kernels):
    torch.manual_seed(1)
    q = torch.randn(2, 12, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 12, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 12, 2, 16, dtype=torch.float64, requires_grad=True)
    out, _ = OPS.fa4_fwd(q, k, v, None, None, -1, -1, 0.25, True, -1, -1, 0.0)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(_ref(q, k, v, 0.25, True)[0], (q, k, v), g)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max() < 1e-5  # the reference is float32 math


def _graph_train(q, k, v, scale, causal):
    return fa4_ops.graph_function().apply(q, k, v, None, None, -1, -1, scale, causal, -1, -1, 0.0, False)


def test_autograd_through_the_graph_function_gives_the_reference_gradient(cpu_kernels):
    torch.manual_seed(1)
    q = torch.randn(2, 12, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 12, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 12, 2, 16, dtype=torch.float64, requires_grad=True)
    out = _graph_train(q, k, v, 0.25, True)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(_ref(q, k, v, 0.25, True)[0], (q, k, v), g)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max() < 1e-5  # the reference is float32 math


def test_the_compile_path_records_fa4_when_it_is_selected(monkeypatch):
    """What AOTAutograd traces under torch.compile: attention()'s traced path with FA4 chosen (a fake H200 with
    flash-attn-4) on fake CUDA tensors: the graph holds attnkit::fa4_fwd; no dense mask is built for the window;
    nothing from flash_attn is imported. Forward only: an autograd node on a fake CUDA tensor aborts a CPU-only
    torch; the ops' autograd (fa4_bwd in the joint graph) is what opcheck's AOT tests above check."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from attnkit.runtime import graph
    from attnkit.runtime import probe as probe_mod
    from attnkit.runtime.call import Inputs

    p = fake_probe((9, 0), ("flash-attn-4",))
    monkeypatch.setattr(probe_mod, "probe", lambda *a, **k: p)
    def step(q, k, v):
        return graph.run_traced(Inputs(q, k, v, causal=True, window=(256, 0)), None, "compile")

    with FakeTensorMode():
        q = torch.empty(2, 4096, 16, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 4096, 4, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 4096, 4, 128, dtype=torch.bfloat16, device="cuda")
        gm = make_fx(step)(q, k, v)  # the inputs are this mode's fake CUDA tensors already
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    # nothing requires grad: the forward without autograd kernel and without log-sum-exp
    assert any("attnkit.fa4_fwd_infer" in t for t in targets), targets
    assert not any("scaled_dot_product" in t or "masked_fill" in t for t in targets), targets
    assert "flash_attn.cute" not in sys.modules


def test_the_traced_call_records_the_autograd_op_only_when_a_gradient_is_needed(monkeypatch):
    """FlashAttn4.bind under trace: graph_function (fa4_fwd_raw and fa4_bwd) for a call that requires grad under
    torch.compile, fa4_fwd (its backward registered) under torch.export, fa4_fwd_infer for a call without grad (a graph's requires_grad is part of dynamo's guards: the two never share a graph)."""
    from types import SimpleNamespace

    from attnkit.runtime.backends.flash_attn4 import FlashAttn4
    from attnkit.runtime.call import Inputs

    seen = []
    fake_ops = SimpleNamespace(fa4_fwd_infer=lambda *a: seen.append("fa4_fwd_infer") or "out",
                               fa4_fwd=lambda *a: seen.append("fa4_fwd") or ("out", "lse"))
    monkeypatch.setattr(fa4_ops, "ops", lambda: fake_ops)
    fake_function = SimpleNamespace(apply=lambda *a: seen.append(("graph_function", a[-1])) or "out")
    monkeypatch.setattr(fa4_ops, "graph_function", lambda: fake_function)
    for grad, export in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(fa4_ops, "exporting", lambda export=export: export)
        q = torch.randn(1, 8, 2, 16, requires_grad=grad)
        call, params = Inputs(q, q, q, causal=True).prepare("compile")
        assert call.requires_grad is grad
        assert FlashAttn4().bind(call, params, q, q, q)(q, q, q) == "out"
    # the last argument: deterministic; torch.export gets the op that carries its backward
    assert seen == ["fa4_fwd_infer", ("graph_function", False), "fa4_fwd"]


def test_compiled_forward_and_backward_run_the_ops_directly(cpu_kernels):
    """torch.compile(fullgraph) of graph_function (attention()'s compiled training path), forward and backward,
    with the CPU reference kernels: the reference gradients, fa4_fwd_raw alone in the forward graph and fa4_bwd
    in the backward graph. The ops are plain torch.library definitions, not custom_op: custom_op's
    per-call aliasing check in its backend_impl wrapper cost 0.43 ms a forward on the H200 (fa4_ops.ops() says
    where that was measured)."""
    from torch._library.custom_ops import _maybe_get_opdef

    assert all(_maybe_get_opdef(f"attnkit::{n}") is None for n in ("fa4_fwd", "fa4_fwd_raw", "fa4_bwd"))
    torch.manual_seed(2)
    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    k = torch.randn(2, 9, 2, 16, requires_grad=True)
    v = torch.randn(2, 9, 2, 16, requires_grad=True)

    train = fa4_ops.graph_function().apply  # as FlashAttn4.bind takes it, outside what dynamo traces

    def f(q, k, v):
        return train(q, k, v, None, None, -1, -1, 0.25, True, -1, -1, 0.0, False)

    g = torch.randn(2, 9, 4, 16)
    want = torch.autograd.grad(_ref(q, k, v, 0.25, True)[0], (q, k, v), g)
    seen = []

    def backend(gm, example_inputs):  # AOTAutograd's graphs, forward and backward, as inductor would get them
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(graph, _):
            seen.append([str(n.target) for n in graph.graph.nodes if n.op == "call_function"])
            return make_boxed_func(graph.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=backend)(q, k, v), (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() < 1e-5
    fwd_ops = [t for t in seen[0] if t.startswith("attnkit.")]
    bwd_ops = [t for t in seen[-1] if t.startswith("attnkit.")]
    assert fwd_ops == ["attnkit.fa4_fwd_raw.default"] and bwd_ops == ["attnkit.fa4_bwd.default"], seen


@pytest.mark.parametrize("path", ["graph_function", "fa4_fwd op"])
def test_a_double_backward_through_fa4_is_refused_in_one_line(cpu_kernels, path):
    """FlashAttention-4 has no double backward: a backward that builds a graph (create_graph=True, the first step of
    a gradient of gradients) raises one line naming the way out (tests/test_fa4_replay.py checks the eager
    Function), instead of giving a gradient without its second-order part."""
    q, k, v = (torch.randn(1, 6, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    if path == "graph_function":
        out = _graph_train(q, k, v, 0.25, True)
    else:
        out = OPS.fa4_fwd(q, k, v, None, None, -1, -1, 0.25, True, -1, -1, 0.0)[0]
    assert torch.autograd.grad(out.sum(), (q,), retain_graph=True)[0].shape == q.shape  # first order works
    with pytest.raises(RuntimeError, match=r"^flash_attn4: FlashAttention-4 has no double backward .*sdpa_math"):
        torch.autograd.grad(out.sum(), (q,), create_graph=True)


@pytest.fixture
def fa4_on_cpu(cpu_kernels, monkeypatch):
    """FlashAttention-4 selectable for CPU tensors (its limits widened to the CPU, a fake H200 probe with
    flash-attn-4), its ops' kernels the CPU reference: attention()'s graph path, runnable here."""
    from dataclasses import replace

    from attnkit.runtime import probe as probe_mod
    from attnkit.runtime.backends.base import ArchLimits
    from attnkit.runtime.backends.flash_attn4 import FlashAttn4

    row = FlashAttn4.limits[0]
    cpu_row = ArchLimits(row.min_capability, row.max_capability,
                         replace(row.limits, devices=frozenset({"cuda", "cpu"})))
    monkeypatch.setattr(FlashAttn4, "limits", (cpu_row,))
    monkeypatch.setattr(FlashAttn4, "extra_unavailable", lambda self, probe: [])
    p = fake_probe((9, 0), ("flash-attn-4",))
    monkeypatch.setattr(probe_mod, "probe", lambda *a, **k: p)


def test_attention_compiled_with_fa4_records_its_ops_and_gives_the_reference_gradient(fa4_on_cpu):
    """attention() under torch.compile(fullgraph=True), FlashAttention-4 selected, forward and backward: the path a
    compiled training step takes (nonstrict_trace, then AOTAutograd tracing graph_function). On this CPU machine
    FA4's limits are widened to the CPU and its kernels are the CPU reference: what is checked is the graph
    (fa4_fwd_raw in the forward, fa4_bwd in the backward, nothing else of attnkit's) and the gradients."""
    import attnkit

    torch.manual_seed(3)
    q = torch.randn(2, 12, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 12, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 12, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 12, 4, 16, dtype=torch.bfloat16)
    want = torch.autograd.grad(_ref(q, k, v, 0.25, True)[0], (q, k, v), g)
    seen = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(graph, _):
            seen.append([str(n.target) for n in graph.graph.nodes if n.op == "call_function"])
            return make_boxed_func(graph.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    def step(q, k, v):
        return attnkit.attention(q, k, v, causal=True, backend="flash_attn4")

    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True, backend=backend)(q, k, v)
    got = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        assert (a.float() - b.float()).abs().max() < 0.05  # bf16 gradients against the float32 reference's
    ours = [[t for t in graph if t.startswith("attnkit.")] for graph in seen]
    assert ours == [["attnkit.fa4_fwd_raw.default"], ["attnkit.fa4_bwd.default"]], seen


def test_torch_export_keeps_fa4_fwd_with_its_backward(fa4_on_cpu):
    """torch.export (its default, non-strict) of a module whose attention() call FA4 serves: the exported program
    holds attnkit::fa4_fwd (the module's weight requires grad: the op that carries its backward), runs, and
    trains. (Strict export fails inside torch on any attention() call, FA4 or not, on torch 2.13: its fake-tensor
    memo is handed the TreeSpec that dynamo's nonstrict_trace passes, "cannot create weak reference".)"""
    import attnkit

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 16, dtype=torch.bfloat16)

        def forward(self, x):
            q = self.proj(x)
            return attnkit.attention(q, x, x, causal=True, backend="flash_attn4")

    torch.manual_seed(4)
    block, x = Block(), torch.randn(2, 8, 4, 16, dtype=torch.bfloat16)
    ep = torch.export.export(block, (x,))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("attnkit.")] == ["attnkit.fa4_fwd.default"], targets
    exported = ep.module()
    got = exported(x)
    want = _ref(block.proj(x), x, x, 0.25, True)[0]
    assert (got.float() - want.float()).abs().max() < 0.05
    # the exported program trains: the weight's gradient is the reference's (the kernels are not differentiable,
    # so it can only come through fa4_fwd's registered backward)
    g = torch.randn_like(got)
    (dw,) = torch.autograd.grad(got, (exported.proj.weight,), g)
    (want_dw,) = torch.autograd.grad(want, (block.proj.weight,), g)
    assert dw.abs().max() > 0 and (dw.float() - want_dw.float()).abs().max() < 0.05 * want_dw.float().abs().max()


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_fa4_bwd_through_the_compiled_and_the_op_path(fa4_on_cpu, deterministic):
    """torch.use_deterministic_algorithms(True) at trace time gives FA4's backward deterministic=True (its
    semaphore-ordered kernel), through attention() compiled and through the fa4_fwd op."""
    import attnkit

    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        torch._dynamo.reset()
        step = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, causal=True, backend="flash_attn4"),
                             fullgraph=True, backend="aot_eager")
        bwd_calls.clear()
        step(q, k, v).sum().backward()
        OPS.fa4_fwd(q, k, v, None, None, -1, -1, 0.25, True, -1, -1, 0.0)[0].sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert bwd_calls == [deterministic, deterministic]
