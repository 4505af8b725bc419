"""The ways into attention() that users take without calling it by hand: torch.compile (fullgraph, dynamic
shapes, backward), torch.jit.trace / both ONNX exporters checked against onnxruntime, and Hugging Face
transformers' attn_implementation="attnkit" against its own "sdpa" and against each sequence run alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

from attnkit.runtime.attention import attention  # noqa: E402
from attnkit.runtime.backends import REGISTRY, reasons  # noqa: E402
from attnkit.runtime.call import Inputs  # noqa: E402


def _qkv(b: int, sq: int, sk: int, h: int, hk: int, d: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g, requires_grad=True) for s, n in ((sq, h), (sk, hk), (sk, hk))]


def _fwd_bwd(f, q, k, v):
    for t in (q, k, v):
        t.grad = None
    out = f(q, k, v)
    out.square().sum().backward()
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


def _run_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- torch.compile -------------------------------------------------------------------------------------------

def test_fresh_process_compiles_with_zero_graph_breaks():
    """No eager call first: the model is explained, then compiled with fullgraph=True, forward and backward.
    torch._dynamo is not imported by attnkit itself (its import costs seconds)."""
    got = _run_python("""
        import json, sys, warnings
        warnings.filterwarnings("ignore")
        import torch
        import attnkit.runtime.attention as A
        dynamo_loaded = "torch._dynamo" in sys.modules

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv, self.o = torch.nn.Linear(64, 128), torch.nn.Linear(64, 64)
            def forward(self, x):
                b, n, _ = x.shape
                q, k, v = self.qkv(x).split([64, 32, 32], -1)
                y = A.attention(q.view(b, n, 4, 16), k.view(b, n, 2, 16), v.view(b, n, 2, 16), causal=True)
                return self.o(y.reshape(b, n, 64))

        m, x = Block(), torch.randn(2, 24, 64)
        ex = torch._dynamo.explain(m)(x)
        torch._dynamo.reset()
        out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        out.sum().backward()
        print(json.dumps({"breaks": ex.graph_break_count, "graphs": ex.graph_count, "dynamo_at_import": dynamo_loaded,
                          "grad": m.qkv.weight.grad is not None}))
    """)
    assert got == {"breaks": 0, "graphs": 1, "dynamo_at_import": False, "grad": True}


CASES = {
    "causal": dict(causal=True),
    "causal fewer queries (bottom-right)": dict(causal=True, sq=8),
    "not causal": dict(causal=False),
    "sliding window": dict(causal=True, window=(3, -1)),
    "two-sided window": dict(causal=False, window=(2, 2)),
    "softcap": dict(causal=True, softcap=5.0),
    "scale": dict(causal=True, softmax_scale=0.3),
}


@pytest.mark.parametrize("dynamic", [None, True])  # True: every size and captured int symbolic (a window
@pytest.mark.parametrize("case", list(CASES))  # captured by the compiled function failed before graph.constant_window)
def test_compiled_fullgraph_matches_eager(case, dynamic):
    kw = dict(CASES[case])
    sq = kw.pop("sq", 16)
    q, k, v = _qkv(2, sq, 16, 4, 2, 32)

    def f(q, k, v):
        return attention(q, k, v, **kw)

    torch._dynamo.reset()
    out, grads = _fwd_bwd(torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic), q, k, v)
    ref, ref_grads = _fwd_bwd(f, q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_a_window_becomes_graph_constants_and_a_bad_one_stays_for_the_check():
    from attnkit.runtime.graph import constant_window

    assert constant_window(None) == (-1, -1) and constant_window([16, 0]) == (16, 0)
    for bad in ((2.5, 0), (True, 0), (1, 2, 3), (1,), ("a", 0)):
        assert constant_window(bad) == tuple(bad)  # attention()'s own validation rejects it in one line
    q, k, v = _qkv(2, 16, 16, 4, 2, 32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="window"):
        torch.compile(lambda q, k, v: attention(q, k, v, causal=True, window=(2.5, 0)), fullgraph=True,
                      backend="aot_eager")(q, k, v)


def test_inductor_compiles_the_kernel_into_one_graph_for_every_length():
    """Sequence length marked dynamic: one graph for three lengths, forward and backward, with torch's SDPA
    kernel op itself in the forward and backward graphs (not a Python fallback)."""
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def keep(gm, _):
        codes.append(gm.code)
        return gm

    def f(q, k, v):
        return attention(q, k, v, causal=True)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recorded = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    inductor = torch.compile(f, fullgraph=True, dynamic=True)
    for s in (16, 24, 40):
        q, k, v = _qkv(2, s, s, 4, 2, 32, seed=s)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 1)
        ref, ref_grads = _fwd_bwd(f, q, k, v)
        for compiled in (recorded, inductor):
            out, grads = _fwd_bwd(compiled, q, k, v)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            for g, r in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert len(codes) == 2, f"expected one forward and one backward graph for 3 lengths, got {len(codes)}"
    ops = [set(re.findall(r"aten\.(\w+)", c)) for c in codes]
    assert any(o.startswith("_scaled_dot_product") and not o.endswith("backward") for o in ops[0]), ops[0]
    assert any(o.startswith("_scaled_dot_product") and o.endswith("backward") for o in ops[1]), ops[1]


def test_compile_backend_eager_runs_the_eager_path():
    q, k, v = _qkv(1, 12, 12, 2, 2, 16)
    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), backend="eager", fullgraph=True)(q, k, v)
    from attnkit.runtime.reference import reference_attention

    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_a_call_no_backend_can_record_says_every_backends_reason_before_dynamos_error(monkeypatch):
    """dynamo turns an error raised inside attnkit's graph call into "Unsupported output type for nonstrict_trace-ed
    function" and drops its message: the reasons come first, as a warning. Packed varlen with a backward on the
    CPU: no backend records it (the padded routes read the lengths on the host, flex has no CPU backward)."""
    from attnkit.runtime.select import ENV_BACKEND, SELECTOR

    monkeypatch.delenv(ENV_BACKEND, raising=False)  # an earlier test's forced backend would be the only reason
    SELECTOR.reset()
    torch._dynamo.reset()
    q, k, v = (torch.randn(30, 4, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    f = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                max_seqlen_q=20, max_seqlen_k=20), fullgraph=True, backend="aot_eager")
    with pytest.warns(RuntimeWarning, match="cannot be recorded into this graph: NoBackendError") as seen, \
            pytest.raises(Exception):  # noqa: B017  (dynamo's own exception type: torch._dynamo.exc.Unsupported)
        f(q, k, v)
    said = next(str(w.message) for w in seen if "cannot be recorded" in str(w.message))
    assert "sdpa:" in said and "flex:" in said and "no backward on CPU" in said


def test_backends_a_graph_cannot_record_are_ruled_out_with_a_reason():
    q, k, v = (t.detach() for t in _qkv(1, 8, 8, 2, 2, 64))
    for trace, words in (("compile", "torch.compile"), ("jit", "torch.jit.trace")):
        call = Inputs(q.half(), k.half(), v.half()).describe(trace)
        on_gpu = call.__class__(**{**call.__dict__, "device": "cuda"})
        why = reasons(REGISTRY["xformers"].limits, on_gpu, (9, 0))
        assert any(f"cannot be recorded by {words}" in r for r in why), why
        assert not any("recorded" in r for r in reasons(REGISTRY["sdpa"].limits, call, None))
        # FlashAttention-4 (attnkit's torch.library ops) and flex (torch's own op): compile yes, jit no
        for name in ("flash_attn4", "flex"):
            recorded = not any("recorded" in r for r in reasons(REGISTRY[name].limits, on_gpu, (9, 0)))
            assert recorded == (trace == "compile"), (name, trace)
    call = Inputs(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=8).describe("compile")
    assert call.lengths_q is None  # never read on the host while tracing
    assert any("host" in r for r in reasons(REGISTRY["sdpa"].limits, call, None))


# --- ONNX: both exporters, checked by onnxruntime ------------------------------------------------------------

class _Attn(torch.nn.Module):
    def __init__(self, heads: int, kv_heads: int, d: int = 16, width: int = 64):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, d
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * d)
        self.o = torch.nn.Linear(heads * d, width)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hk * self.d, self.hk * self.d], -1)
        y = attention(q.view(b, n, self.h, self.d), k.view(b, n, self.hk, self.d), v.view(b, n, self.hk, self.d),
                      causal=True)
        return self.o(y.reshape(b, n, -1))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_onnx_export_matches_onnxruntime(tmp_path, dynamo, kv_heads):
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(kv_heads)
    model, x = _Attn(4, kv_heads).eval(), torch.randn(2, 12, 64)
    with torch.no_grad():
        ref = model(x).numpy()
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo, input_names=["x"], output_names=["y"])
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    assert abs(got - ref).max() < 1e-5


# --- Hugging Face transformers ------------------------------------------------------------------------------

def _tiny(arch: str, **extra):
    transformers = pytest.importorskip("transformers")
    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)
    config = getattr(transformers, f"{arch}Config")(**common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit").float()


def _logits_and_grads(model, impl: str, **inputs):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(**inputs).logits
    keep = inputs.get("attention_mask")
    if keep is not None:
        logits = logits * keep[..., None]  # padded positions are not defined the same way by every kernel
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_hf_model_same_logits_and_grads_as_sdpa(arch, padded):
    model = _tiny(arch)
    assert model.config._attn_implementation == "attnkit"
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(1))
    inputs: dict = {"input_ids": ids}
    if padded:
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[1, :5] = 0  # left padding
        mask[2, 14:] = 0  # right padding
        inputs["attention_mask"] = mask
    ours, our_grads = _logits_and_grads(model, "attnkit", **inputs)
    ref, ref_grads = _logits_and_grads(model, "sdpa", **inputs)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(our_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_hf_packed_sequences_equal_each_sequence_alone():
    """Packed into one row: restarting position ids, or DataCollatorWithFlattening's cu_seq_lens_* kwargs.
    The oracle is every sequence run on its own."""
    model = _tiny("Llama").eval()
    lengths = (7, 9, 4)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
        by_positions = model(input_ids=ids, position_ids=positions).logits
        by_kwargs = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=9, max_length_k=9).logits
    torch.testing.assert_close(by_positions, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_kwargs, alone, rtol=1e-5, atol=1e-5)


def test_hf_sliding_window_and_softcap_match_eager():
    """Qwen2 with a sliding window shorter than the sequence; Gemma2-style logit softcapping (not in SDPA:
    HF's 'eager' is the reference)."""
    model = _tiny("Qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    ours, _ = _logits_and_grads(model, "attnkit", input_ids=ids)
    ref, _ = _logits_and_grads(model, "sdpa", input_ids=ids)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    gemma = _tiny("Gemma2", head_dim=16, attn_logit_softcapping=20.0, sliding_window=6, query_pre_attn_scalar=16)
    ours, _ = _logits_and_grads(gemma, "attnkit", input_ids=ids)
    ref, _ = _logits_and_grads(gemma, "eager", input_ids=ids)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_hf_compiled_model_has_no_graph_breaks_and_matches():
    model = _tiny("Llama")
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_hf_padded_batch_compiles_with_zero_graph_breaks_and_matches_eager():
    """A padded batch (left and right padding) under torch.compile(fullgraph=True): no host data in the graph,
    logits of every real token and every gradient equal to the eager model's."""
    model = _tiny("Llama")
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    mask[2, 13:] = 0  # right padding
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    ref, ref_grads = _logits_and_grads(model, "attnkit", input_ids=ids, attention_mask=mask)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad()
    logits = compiled(input_ids=ids, attention_mask=mask).logits * mask[..., None]
    assert torch.isfinite(logits).all()
    logits.square().mean().backward()
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padded_segments_pack_a_padded_batch_on_the_device():
    """Each row's tokens first, in order, then its padding, as two sequences (an empty one where a row has no
    padding): for left, right and no padding, and a row of padding only."""
    from attnkit.integrations.transformers import padded_segments

    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
    perm, cu = padded_segments(mask, 4)
    assert perm.tolist() == [0, 1, 2, 3, 6, 7, 4, 5, 8, 9, 10, 11, 12, 13, 14, 15]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 4, 6, 8, 11, 12, 12, 16]
    assert sorted(perm.tolist()) == list(range(16))  # a permutation: index_copy back writes every row once


def test_padded_segments_give_the_masked_calls_output_and_gradients():
    """What a graph runs for a padded batch, eagerly: padded_segments' gather, attention()'s varlen call and the
    index_copy back give every real token the output of the masked call, and q, k, v the same gradients through
    the real tokens (left and right padding, causal and a window)."""
    from attnkit.integrations.transformers import padded_segments
    from attnkit.runtime.layout import allowed_mask

    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 9:] = 0
    lengths = mask.sum(-1)
    real = mask.bool()[..., None, None]
    for opts in ({"causal": True}, {"causal": False, "window": (3, 2)}):
        q, k, v = _qkv(3, 12, 12, 4, 2, 16, seed=3)
        perm, cu = padded_segments(mask, 12)
        flat = [t.reshape(36, *t.shape[2:]).index_select(0, perm) for t in (q, k, v)]
        got = attention(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12, **opts)
        got = torch.empty_like(got).index_copy(0, perm, got).view(3, 12, 4, 16)
        (got * real).square().sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        # the reference: each row's real tokens alone, packed to the front, against the plain masked math
        ref = torch.zeros_like(got)
        for b in range(3):
            keep = mask[b].bool()
            n = int(lengths[b])
            ok = allowed_mask(n, n, causal=opts["causal"], window=opts.get("window"), device="cpu").reshape(n, n)
            qs, ks, vs = (t[b, keep].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
            ref[b, keep] = torch.softmax((qs @ ks.transpose(-1, -2) / 4).masked_fill(~ok, float("-inf")), -1).matmul(
                vs).transpose(0, 1)
        (ref * real).square().sum().backward()
        torch.testing.assert_close(got * real, ref * real, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, (q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_hf_padded_batch_compiled_runs_the_varlen_path_and_matches_eager():
    """A padded batch (left and right padding) compiled without a backward: packed on the device
    (padded_segments) and recorded by a varlen backend (flex on the CPU), no graph break, the logits of every real
    token equal to the eager model's. With a backward on the CPU no varlen backend records the call, and the key
    bias serves it (the test above)."""
    from attnkit.runtime import graph

    model = _tiny("Llama").eval()
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :6] = 0
    mask[2, 13:] = 0
    calls = []
    real = graph.run_traced
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits * mask[..., None]
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
        assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
        torch._dynamo.reset()
        try:
            graph.run_traced = lambda inp, backend, trace: calls.append(inp.cu_seqlens_q is not None) or real(
                inp, backend, trace)
            out = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, attention_mask=mask).logits
        finally:
            graph.run_traced = real
    assert calls and all(calls)  # every layer's call went to the varlen path
    torch.testing.assert_close(out * mask[..., None], ref, rtol=1e-5, atol=1e-5)


def test_a_graph_records_varlen_where_a_backend_takes_it(monkeypatch):
    """graph.records_varlen, the adapter's question before packing in a graph: on the CPU only forward (flex has
    no CPU backward); on a fake H200 with FlashAttention-4, forward and backward."""
    from test_selection import fake_probe

    from attnkit.runtime import graph
    from attnkit.runtime import probe as probe_mod

    args = dict(device="cpu", device_index=0, dtype="float32", heads=4, kv_heads=2, head_dim=16, head_dim_v=16,
                causal=True, window=None, softcap=False, dropout=False)
    assert graph.records_varlen(**args, requires_grad=False) and not graph.records_varlen(**args, requires_grad=True)
    # inside torch.compile(dynamic=True) flex refuses the graph (GRAPH_DYNAMIC), so nothing records it on the CPU:
    # the adapter then takes its key-bias path instead of packing into a call no backend serves
    import torch._dynamo

    with torch._dynamo.config.patch(assume_static_by_default=False):
        assert not graph.records_varlen(**args, requires_grad=False)
    from attnkit.integrations.transformers import (
        _varlen_records,  # any of q, k, v with a grad (LoRA on v only)
    )

    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 4, 2, 16)
    opts = {"causal": True, "softcap": 0.0, "dropout_p": 0.0}
    assert _varlen_records(q, k, k, opts) and not _varlen_records(q, k, k.clone().requires_grad_(), opts)
    p = fake_probe((9, 0), ("flash-attn-4",))
    monkeypatch.setattr(probe_mod, "probe", lambda *a, **k: p)
    h200 = {**args, "device": "cuda", "dtype": "bfloat16", "head_dim": 128, "head_dim_v": 128}
    assert graph.records_varlen(**h200, requires_grad=True)
    assert not graph.records_varlen(**{**h200, "dtype": "float64"}, requires_grad=True)


def test_hf_packed_batch_compiles_with_zero_graph_breaks_and_equals_each_sequence_alone():
    """DataCollatorWithFlattening's kwargs under torch.compile(fullgraph=True): the cu_seq_lens stay device
    tensors, the varlen call is recorded (here, on the CPU, by flex; on a GPU by FlashAttention-4's ops)."""
    model = _tiny("Llama").eval()
    lengths = (7, 9, 4)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    kw = dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=9, max_length_k=9)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids, **kw)
        assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, **kw).logits
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


def test_hf_refuses_what_it_cannot_serve_in_one_line():
    from attnkit.integrations.transformers import UnsupportedCall, attention_forward

    q = torch.randn(1, 2, 4, 8)
    mask4d = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(UnsupportedCall, match=r"^attn_implementation='attnkit' does not support a 4D attention mask"):
        attention_forward(torch.nn.Module(), q, q, q, mask4d)
    with pytest.raises(UnsupportedCall, match="attention sinks"):
        attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


def test_hf_from_pretrained_with_attnkit(tmp_path):
    transformers = pytest.importorskip("transformers")
    _tiny("Llama").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="attnkit")
    assert model.config._attn_implementation == "attnkit"


def test_import_attnkit_does_not_import_transformers():
    got = _run_python("""
        import json, sys
        import attnkit, attnkit.runtime.attention
        print(json.dumps({"transformers": "transformers" in sys.modules}))
    """)
    assert got == {"transformers": False}


def test_bench_batches_padded_and_packed_predict_the_same_tokens():
    """The integrations bench's training batches (bench/integrations.py batch_of): the padded batch and the same
    sequences packed by DataCollatorWithFlattening give one loss on attnkit, and the full rows another."""
    pytest.importorskip("transformers")
    from attnkit.bench.integrations import batch_of

    model = _tiny("Llama")
    losses = {}
    for kind in ("full", "padded", "packed"):
        inputs = batch_of(kind, 3, 24, 128, "cpu")
        with torch.no_grad():
            losses[kind] = float(model(**inputs).loss)
    packed = batch_of("packed", 3, 24, 128, "cpu")
    assert packed["input_ids"].shape[0] == 1 and int(packed["cu_seq_lens_q"][-1]) == packed["input_ids"].shape[1]
    assert abs(losses["padded"] - losses["packed"]) < 1e-5, losses
    assert abs(losses["full"] - losses["padded"]) > 1e-4, losses  # the padding really removed tokens
    with pytest.raises(ValueError, match="batch kind 'ragged'"):
        batch_of("ragged", 3, 24, 128, "cpu")
