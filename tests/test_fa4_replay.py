"""FlashAttention-4's forward replay (runtime/backends/fa4_replay.py) against a stand-in `flash_attn.cute.interface`
on the CPU: the stand-in has FA4's shape (a `_flash_attn_fwd` whose JIT cache hands out a compiled function, called
once with q, k, v, out, lse and constants), so these tests check the record / verify / replay protocol and every
refusal. The real FA4 path is checked on the H200 by tools/probe-fa4-replay.py (bitwise against FA4's own call)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from attnkit.runtime import loaders
from attnkit.runtime.backends import fa4_replay


@dataclasses.dataclass
class AuxData:  # FA4 passes one of these (aux tensors, aux scalars) to its kernels
    tensors: object = None
    scalars: object = None


class Fake:
    """A stand-in interface module; `mode` picks a behaviour a test wants FA4's host path to have."""

    def __init__(self) -> None:
        self.mode = "plain"
        self.host_calls = 0
        self.launches = 0
        self.noise = 0.0
        self.held = torch.ones(1)  # a tensor FA4 would hold across calls (an aux tensor)

    def kernel(self, q, k, v, out, lse, scale, cu_q, cu_k, wl, wr, aux):
        with _disable_current_modes():  # a CuTe kernel runs no aten op; the stand-in's math must not show as one
            self.launches += 1
            g = q.shape[-2] // k.shape[-2]
            kk, vv = k.repeat_interleave(g, -2), v.repeat_interleave(g, -2)
            s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) * scale
            out.copy_(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv.float()).to(out.dtype) + self.noise)
            if lse is not None:
                lse.copy_(s.logsumexp(-1))

    def make(self):
        fake = self
        cache: dict = {}

        def _flash_attn_fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                            max_seqlen_k=None, softmax_scale=None, causal=False, window_size_left=None,
                            window_size_right=None, softcap=None, return_lse=False):
            fake.host_calls += 1
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1]) if return_lse else None
            key = (tuple(q.shape), q.dtype, causal)
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = fake.kernel
            qq = q.detach()
            if fake.mode == "derived":
                qq = fake.other  # a tensor of FA4's own (a staged copy, a workspace), not one the call passed
            if fake.mode == "zero":
                out.zero_()
            args = [qq, k.detach(), v.detach(), out.detach(), lse, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                    window_size_left, window_size_right, AuxData()]
            if fake.mode == "tensor_const":
                args[-1] = AuxData(tensors=fake.held)
            _flash_attn_fwd.compile_cache[key](*args)
            if fake.mode == "two":
                _flash_attn_fwd.compile_cache[key](*args)
            return out, lse, None, None, None

        _flash_attn_fwd.compile_cache = cache
        mod = types.ModuleType("flash_attn.cute.interface")
        mod._flash_attn_fwd = _flash_attn_fwd
        self.make_backward(mod)
        return mod

    def make_backward(self, mod):
        """FA4's backward's shape: dq/dk/dv and float32 work buffers allocated (a zero-filled dk accumulator), then
        a preprocess, the main kernel and a postprocess, each from its own JIT cache."""
        fake = self
        self.bwd_host_calls = 0
        self.bwd_calls = []
        self.bwd_mode = "plain"

        def pre_kernel(dq_accum):
            with _disable_current_modes():
                dq_accum.zero_()

        def main_kernel(q, k, v, dout, scale, dq_accum, dk_accum, dv):
            with _disable_current_modes():
                with torch.enable_grad():
                    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
                    gq, gk, gv = torch.autograd.grad(_reference(q64, k64, v64, scale), (q64, k64, v64), dout.double())
                dq_accum.add_(gq.float())
                dk_accum.add_(gk.float())  # an accumulator that must start at zero
                dv.copy_(gv.to(dv.dtype))

        def post_kernel(accum, output):
            with _disable_current_modes():
                output.copy_(accum.to(output.dtype))

        def jit(name, kernel):
            def launch(key, *args):
                if key not in launch.compile_cache:
                    launch.compile_cache[key] = kernel
                launch.compile_cache[key](*args)
            launch.__name__ = name
            launch.compile_cache = {}
            setattr(mod, name, launch)
            return launch

        pre, post, main = jit("_bwd_preprocess", pre_kernel), jit("_bwd_postprocess_convert", post_kernel), None

        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, **kw):
            fake.bwd_host_calls += 1
            fake.bwd_calls.append({"out": out, "lse": lse, "scale": softmax_scale, "causal": causal,
                                   "softcap": softcap, **kw})
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            dq_accum = torch.empty(q.shape, dtype=torch.float32)
            dk_accum = torch.zeros(k.shape, dtype=torch.float32)
            key = (tuple(q.shape), q.dtype)
            pre(key, dq_accum)
            d = dout * 1.0 if fake.bwd_mode == "other" else dout  # an aten op of FA4's own on the call's data
            if key not in _flash_attn_bwd.compile_cache:
                _flash_attn_bwd.compile_cache[key] = main_kernel
            _flash_attn_bwd.compile_cache[key](q, k, v, d, softmax_scale, dq_accum, dk_accum, dv)
            post(key, dq_accum, dq)
            post(key, dk_accum, dk)
            return dq, dk, dv

        _flash_attn_bwd.compile_cache = {}
        mod._flash_attn_bwd = _flash_attn_bwd
        del main


@pytest.fixture
def fake(monkeypatch):
    f = Fake()
    interface = f.make()
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setattr(loaders, "FA4_STATE", {"module": cute})
    monkeypatch.delenv(fa4_replay.ENV, raising=False)
    fa4_replay.clear()
    yield f
    fa4_replay.clear()


def _qkv(b=2, sq=5, sk=7, h=4, hk=2, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, h, d, generator=g), torch.randn(b, sk, hk, d, generator=g),
            torch.randn(b, sk, hk, d, generator=g))


def _fwd(q, k, v, **kw):
    args = dict(softmax_scale=0.3, causal=False, window_size_left=None, window_size_right=None)
    args.update(kw)
    return fa4_replay.forward(q, k, v, **args)


def test_compile_then_record_then_verify_then_replay_without_the_host_path(fake):
    q, k, v = _qkv()
    outs = [_fwd(q, k, v, return_lse=True) for _ in range(6)]
    # call 1 compiles (not recorded), 2 records, 3 verifies (FA4's own call and the plan), 4-6 replay
    assert fake.host_calls == 3
    assert fake.launches == 7  # 3 host-path launches + the verifying replay + 3 replays
    s = fa4_replay.stats()
    assert (s["recorded"], s["verified"], s["replayed"], s["refused"]) == (1, 1, 3, 0)
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    assert outs[-1][0] is not outs[-2][0]  # a fresh output each call, never a shared buffer


def test_each_signature_gets_its_own_plan(fake):
    q, k, v = _qkv()
    for _ in range(4):
        _fwd(q, k, v)
    before = fake.host_calls
    q2, k2, v2 = _qkv(sq=3)
    out = [_fwd(q2, k2, v2) for _ in range(4)][-1][0]
    assert fake.host_calls == before + 3 and out.shape == (2, 3, 4, 8)
    for _ in range(2):  # a scalar argument is part of the signature too
        _fwd(q, k, v, softmax_scale=0.5)
    assert fake.host_calls == before + 5
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides: not the same signature
    _fwd(qt, k, v)
    assert fake.host_calls == before + 6


@pytest.mark.parametrize("mode, why", [
    ("derived", "derived from the call"),
    ("zero", "ran zero_"),
    ("two", "2 compiled launches"),
    ("tensor_const", "holds tensors"),
])
def test_a_host_path_doing_more_than_one_plain_launch_is_never_replayed(fake, mode, why):
    fake.mode = mode
    q, k, v = _qkv()
    fake.other = q.clone()
    for _ in range(5):
        _fwd(q, k, v)
    assert fake.host_calls == 5  # every call on FA4's own path
    s = fa4_replay.stats()
    assert s["replayed"] == 0 and s["refused"] == 1
    assert any(why in r for r in s["refusals"]), s["refusals"]


def test_a_plan_whose_output_differs_from_fa4s_own_call_is_dropped(fake):
    q, k, v = _qkv()
    _fwd(q, k, v)
    _fwd(q, k, v)  # recorded
    orig = fake.kernel

    def drifting(*a):  # the replayed launch writes something else than FA4's own call
        orig(*a)
        a[3].add_(1.0)
    # the plan holds the compiled function it recorded: make that one drift
    plan = next(p for p in fa4_replay._PLANS.values() if isinstance(p, fa4_replay.Plan))
    plan.fn = drifting
    for _ in range(3):
        _fwd(q, k, v)
    s = fa4_replay.stats()
    assert s["verified"] == 0 and s["replayed"] == 0 and s["refused"] == 1
    assert any("differs" in r for r in s["refusals"])
    assert fake.host_calls == 5


def test_switched_off_by_the_environment(fake, monkeypatch):
    monkeypatch.setenv(fa4_replay.ENV, "0")
    q, k, v = _qkv()
    for _ in range(4):
        _fwd(q, k, v)
    assert fake.host_calls == 4 and fa4_replay.stats()["plans"] == 0


def test_a_compiling_signature_is_refused_after_three_tries(fake, monkeypatch):
    q, k, v = _qkv()
    interface = sys.modules["flash_attn.cute.interface"]

    class Forgetful(dict):  # a cache that never keeps what it compiled: every call compiles
        def __contains__(self, key):
            return False
    interface._flash_attn_fwd.compile_cache = Forgetful()
    for _ in range(5):
        _fwd(q, k, v)
    s = fa4_replay.stats()
    assert fake.host_calls == 5 and s["replayed"] == 0
    assert any("compiled on each of 3 calls" in r for r in s["refusals"])


def test_the_watched_caches_are_restored_even_when_fa4_raises(fake):
    interface = sys.modules["flash_attn.cute.interface"]
    cache = interface._flash_attn_fwd.compile_cache
    q, k, v = _qkv()
    _fwd(q, k, v)  # compiled
    fake.mode = "two"
    orig = fake.kernel

    def boom(*a):
        raise RuntimeError("kernel failed")
    cache[next(iter(cache))] = boom
    with pytest.raises(RuntimeError, match="kernel failed"):
        _fwd(q, k, v)
    assert interface._flash_attn_fwd.compile_cache is cache
    del orig


def _reference(q, k, v, scale):
    g = q.shape[-2] // k.shape[-2]
    kk, vv = k.repeat_interleave(g, -2), v.repeat_interleave(g, -2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)


def test_training_calls_replay_the_forward_and_run_fa4s_backward(fake, monkeypatch):
    """flash_attn4's eager runner: inputs that require grad go through fa4_ops.eager_function: its forward is the
    replayed one (FA4's host path runs only to compile, record and verify), its backward FA4's `_flash_attn_bwd`
    with the forward's own out and log-sum-exp; FA4's flash_attn_func (its whole host path) is never called."""
    from attnkit.runtime.backends.flash_attn4 import FlashAttn4
    from attnkit.runtime.call import Inputs

    used = []
    cute = sys.modules["flash_attn.cute"]
    cute.flash_attn_func = lambda q, k, v, **kw: (used.append("func"), (q.clone(), None))[1]
    q, k, v = _qkv()
    inputs = Inputs(q, k, v, softmax_scale=0.3)
    call = inputs.describe()
    run = FlashAttn4().bind(call, inputs.params(call), q, k, v)
    for i in range(5):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = run(qg, kg, vg)
        dout = torch.randn_like(out)
        out.backward(dout)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = _reference(q64, k64, v64, 0.3)
        ref.backward(dout.double())
        assert torch.allclose(out.double(), ref, atol=1e-5)
        for got, want in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
            assert got is not None and got.shape == want.shape and torch.allclose(got.double(), want, atol=1e-5)
        if i < 3:  # FA4's own backward ran (compile, record, verify): it got the forward's own out and lse
            seen = fake.bwd_calls[-1]
            assert seen["lse"] is not None and seen["lse"].shape == (2, 4, 5) and seen["out"].shape == out.shape
            assert torch.equal(seen["out"], out.detach()) and seen["deterministic"] is False and seen["scale"] == 0.3
    assert used == [] and len(fake.bwd_calls) == 3  # backward: compile, record, verify; calls 4 and 5 replayed
    assert fake.host_calls == 3  # forward: compile, record, verify: calls 4 and 5 replayed
    assert fa4_replay.stats()["replayed"] == 4
    with torch.no_grad():  # the same call without grad: the replay without a log-sum-exp, another signature
        run(q, k, v)
    assert used == [] and fake.host_calls == 4


def test_switched_off_the_backend_calls_fa4s_own_functions(fake, monkeypatch):
    """ATTNKIT_FA4_REPLAY=0: every call goes through flash_attn_func, FA4's own autograd.Function."""
    from attnkit.runtime.backends.flash_attn4 import FlashAttn4
    from attnkit.runtime.call import Inputs

    monkeypatch.setenv(fa4_replay.ENV, "0")
    used = []
    cute = sys.modules["flash_attn.cute"]
    cute.flash_attn_func = lambda q, k, v, **kw: (used.append(kw), (q.clone(), None))[1]
    q, k, v = _qkv()
    inputs = Inputs(q, k, v, softmax_scale=0.3)
    call = inputs.describe()
    run = FlashAttn4().bind(call, inputs.params(call), q, k, v)
    run(q.clone().requires_grad_(), k, v)
    with torch.no_grad():
        run(q, k, v)
    assert len(used) == 2 and used[0]["softmax_scale"] == 0.3 and fake.host_calls == 0


def _bwd(fake, q, k, v, scale=0.3):
    out, lse = _fwd(q, k, v, softmax_scale=scale, return_lse=True)
    dout = torch.randn_like(out)
    return fa4_replay.backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=False, softcap=0.0,
                               window_size_left=None, window_size_right=None), (out, dout)


def _bwd_reference(q, k, v, dout, scale=0.3):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(_reference(q64, k64, v64, scale), (q64, k64, v64), dout.double())


def test_backward_records_allocations_fills_and_its_launches_then_replays_them(fake):
    q, k, v = _qkv()
    for _ in range(6):
        grads, (_, dout) = _bwd(fake, q, k, v)
        for got, want in zip(grads, _bwd_reference(q, k, v, dout), strict=True):
            assert torch.allclose(got.double(), want, atol=1e-5)
    assert fake.bwd_host_calls == 3  # compile, record, verify; then 3 replays
    plan = next(p for p in fa4_replay._PLANS.values() if isinstance(p, fa4_replay.StepPlan))
    kinds = [st[0] for st in plan.steps]
    assert kinds.count("alloc") == 5 and kinds.count("launch") == 4 and plan.verified
    zero = [st for st in plan.steps if st[0] == "fill"]  # dk's accumulator is zero-filled on every replay
    assert zero == [("fill", 4, 0)] and plan.outputs == (0, 1, 2)
    launch_names = [st[1] for st in plan.steps if st[0] == "launch"]
    assert launch_names == ["_bwd_preprocess", "_flash_attn_bwd", "_bwd_postprocess_convert",
                            "_bwd_postprocess_convert"]


def test_a_backward_running_other_aten_ops_stays_on_fa4s_own_path(fake):
    fake.bwd_mode = "other"
    q, k, v = _qkv()
    for _ in range(4):
        grads, (_, dout) = _bwd(fake, q, k, v)
    assert fake.bwd_host_calls == 4
    assert any("ran mul" in r for r in fa4_replay.stats()["refusals"]), fa4_replay.stats()["refusals"]
    for got, want in zip(grads, _bwd_reference(q, k, v, dout), strict=True):
        assert torch.allclose(got.double(), want, atol=1e-5)


def test_a_backward_plan_whose_fill_differs_is_dropped_at_verification(fake):
    q, k, v = _qkv()
    _bwd(fake, q, k, v)
    _bwd(fake, q, k, v)  # recorded
    plan = next(p for p in fa4_replay._PLANS.values() if isinstance(p, fa4_replay.StepPlan))
    # the accumulator's fill replaced by a fill with garbage: its replay sums onto it
    plan.steps = tuple(("fill", st[1], 7.0) if st[0] == "fill" else st for st in plan.steps)
    for _ in range(3):
        grads, (_, dout) = _bwd(fake, q, k, v)
    s = fa4_replay.stats()
    assert any("differ from FlashAttention-4's own backward" in r for r in s["refusals"]), s["refusals"]
    assert fake.bwd_host_calls == 5
    for got, want in zip(grads, _bwd_reference(q, k, v, dout), strict=True):
        assert torch.allclose(got.double(), want, atol=1e-5)


def test_close_allows_rounding_but_not_a_wrong_gradient():
    b = torch.randn(64, 32).to(torch.bfloat16)
    ulp = b.float() * (1 + 2 ** -8)  # one bfloat16 step up, where rounding of reordered atomics lands
    assert fa4_replay._close(ulp.to(torch.bfloat16), b)
    assert not fa4_replay._close((b.float() * 1.1).to(torch.bfloat16), b)
    assert not fa4_replay._close(b.float().to(torch.bfloat16), b.float())  # another dtype
    nan = b.clone()
    nan[0, 0] = float("nan")
    assert not fa4_replay._close(nan, b)


def test_a_double_backward_through_the_training_path_raises(fake):
    """FA4 has no double backward: the backward that would build a gradient's graph (create_graph=True) raises one
    line naming the way out, never gives a gradient without its second-order part."""
    from attnkit.runtime.backends.fa4_ops import eager_function

    q, k, v = (t.requires_grad_() for t in _qkv())
    out = eager_function().apply(q, k, v, None, None, -1, -1, 0.3, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match=r"^flash_attn4: FlashAttention-4 has no double backward .*sdpa_math"):
        torch.autograd.grad((out ** 2).sum(), (q,), create_graph=True)
    assert torch.autograd.grad((out ** 2).sum(), (q,))[0].shape == q.shape  # the first-order gradient still runs


def test_a_plan_recorded_with_k_is_v_never_serves_a_call_with_two_tensors(fake):
    """A plan maps launch arguments to the call's tensors by pointer: recorded with k is v, it would hand k where
    v belongs. Which tensors alias is part of the signature, so the other call gets its own plan."""
    q, k, v = _qkv()
    for _ in range(5):
        _fwd(q, k, k)  # compile, record, verify, replay x2: a plan for k is v
    assert fa4_replay.stats()["replayed"] == 2
    out = _fwd(q, k, v)[0]
    assert torch.allclose(out.double(), _reference(q.double(), k.double(), v.double(), 0.3), atol=1e-5)
    assert fa4_replay.stats()["replayed"] == 2  # not replayed: a first call of its own signature


def test_signatures_that_never_come_again_are_never_recorded(fake):
    """Packed batches with new lengths each step: each signature is seen once, so nothing is recorded (the
    recording's dispatch mode would only slow those calls down), and each runs FA4's own path."""
    for sq in range(3, 9):
        q, k, v = _qkv(sq=sq)
        _fwd(q, k, v)
    s = fa4_replay.stats()
    assert s["recorded"] == 0 and s["plans"] == 0 and s["own_path"] == 6 and fake.host_calls == 6


def test_verification_poisons_what_fa4_did_not_fill_so_a_missed_launch_shows(fake):
    """A plan that lost a launch (here dk's postprocess) leaves dk as allocated: verification starts every
    allocation FA4 did not fill as NaN, so it is refused even where memory still held FA4's own values."""
    q, k, v = _qkv()
    _bwd(fake, q, k, v)
    _bwd(fake, q, k, v)  # recorded
    plan = next(p for p in fa4_replay._PLANS.values() if isinstance(p, fa4_replay.StepPlan))
    last = max(i for i, st in enumerate(plan.steps) if st[0] == "launch")
    plan.steps = plan.steps[:last] + plan.steps[last + 1:]
    for _ in range(3):
        grads, (_, dout) = _bwd(fake, q, k, v)
        for got, want in zip(grads, _bwd_reference(q, k, v, dout), strict=True):
            assert torch.allclose(got.double(), want, atol=1e-5)
    s = fa4_replay.stats()
    assert s["bwd_verified"] == 0 and s["bwd_replayed"] == 0
    assert any("differ from FlashAttention-4's own backward" in r for r in s["refusals"]), s["refusals"]
