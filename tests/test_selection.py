"""Selection logic with fake probes (sm70/80/90/100) and fake backends; errors list every backend."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from attnkit.runtime import select as sel
from attnkit.runtime import table
from attnkit.runtime.backends import REGISTRY, Backend, Limits, reasons
from attnkit.runtime.call import AttentionCall
from attnkit.runtime.probe import GPU, Library, Probe, TorchInfo


def fake_probe(cc: tuple[int, int] | None, libs: tuple[str, ...] = (), cudnn: int = 91900) -> Probe:
    gpus = () if cc is None else (GPU(0, f"Fake sm{cc[0]}{cc[1]}", cc, 80000, 100),)
    libraries = tuple(Library(n, n, "1.0", n in libs, n in libs)
                      for n in ("flash-attn", "flash-attn-3", "flash-attn-4", "xformers", "cudnn-frontend"))
    return Probe("3.12.3", "linux-x86_64", "580.0", gpus, TorchInfo("2.11.0", "13.0", cudnn, True, cc is not None),
                 libraries, "nvml")


def call(**kw) -> AttentionCall:
    base = AttentionCall(device="cuda", device_index=0, dtype="bfloat16", batch=8, seqlen_q=4096, seqlen_k=4096,
                         heads=16, kv_heads=16, head_dim=128, head_dim_v=128, causal=True, dropout=False,
                         window=None, alibi=False, bias=False, varlen=False, requires_grad=True)
    return replace(base, **kw)


@pytest.fixture(autouse=True)
def fresh_selector(monkeypatch, tmp_path):
    monkeypatch.delenv(sel.ENV_BACKEND, raising=False)
    monkeypatch.delenv(sel.ENV_AUTOTUNE, raising=False)
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    # the hand-written rows and the limits, as on a GPU without a table: the packaged table's own tests are in
    # test_tune_table.py, and a table that grows with each sweep must not change what these assert
    (tmp_path / "no-tables").mkdir()
    monkeypatch.setenv(table.ENV_TABLES, str(tmp_path / "no-tables"))
    table.load.cache_clear()
    sel.SELECTOR.reset()
    yield
    sel.SELECTOR.reset()
    table.load.cache_clear()


@pytest.mark.parametrize(
    ("cc", "libs", "expected"),
    [
        ((9, 0), (), "sdpa_cudnn"),  # Hopper: cuDNN ~1.8x FA2 (docs/results/*-h200-bench-flash-attn.json)
        ((9, 0), ("flash-attn",), "sdpa_cudnn"),  # flash-attn installed is NOT the fast choice on H200
        ((9, 0), ("flash-attn", "flash-attn-4"), "flash_attn4"),  # long D128 training: FA4 1.10-1.15x cuDNN
        ((10, 0), ("flash-attn",), "sdpa_cudnn"),
        ((8, 0), ("flash-attn",), "flash_attn2"),
        ((8, 0), (), "sdpa_flash"),
        ((8, 6), ("xformers",), "sdpa_flash"),
        ((7, 0), ("xformers",), "xformers"),  # V100: only xformers or SDPA efficient/math
        ((7, 0), (), "sdpa_efficient"),
    ],
)
def test_priority_per_architecture(cc, libs, expected):
    assert sel.SELECTOR.select(call(), fake_probe(cc, libs)).name == expected


def test_v100_never_gets_flash_kernels():
    p = fake_probe((7, 0), ("flash-attn", "flash-attn-3", "xformers"))
    why = sel.explain(call(), p)
    for name in ("flash_attn2", "flash_attn3", "sdpa_flash", "sdpa_cudnn", "torch_varlen"):
        assert any("compute capability" in r for r in why[name]), (name, why[name])
    assert why["xformers"] == [] and why["sdpa_efficient"] == [] and why["sdpa_math"] == []


def test_features_route_to_capable_backends():
    p = fake_probe((9, 0))
    pick = lambda **kw: sel.SELECTOR.select(call(**kw), p).name  # noqa: E731
    assert pick(head_dim=256, head_dim_v=256) == "sdpa_cudnn"  # measured: cuDNN has D<=256 kernels on sm90
    assert pick(head_dim=512, head_dim_v=512) == "sdpa"  # no fused kernel declares it: torch's own pick
    assert pick(seqlen_q=128) == "sdpa"  # chunked prefill without FA4: torch's native bottom-right flash
    assert pick(window=(256, 0)) == "sdpa_cudnn"
    # without FA4 and cudnn-frontend: torch's native varlen kernel, ahead of sdpa_cudnn_varlen's per-sequence host
    # work (priority.DEFAULTS); the bucketed cuDNN route stays next (a torch without torch.nn.attention.varlen, < 2.10)
    assert pick(varlen=True, lengths_q=(3, 4), lengths_k=(3, 4)) == "torch_varlen"
    why = sel.explain(call(varlen=True, lengths_q=(3, 4), lengths_k=(3, 4), dtype="float32"), p)
    assert why["torch_varlen"] and why["sdpa_cudnn_varlen"]  # both half precision only: said, not hidden
    assert pick(varlen=True, lengths_q=(3, 4), lengths_k=(5, 4)) == "torch_varlen"
    assert pick(dtype="float32") == "sdpa_efficient"  # measured: k/v expanded beats torch's math fallback on GQA
    assert pick(dtype="float64") == "sdpa"
    assert pick(dtype="float16", head_dim=250, head_dim_v=250) == "sdpa"  # not a multiple of 8
    p2 = fake_probe((9, 0), ("flash-attn",))
    assert sel.SELECTOR.select(call(varlen=True, alibi=True, lengths_q=(3,), lengths_k=(3,)), p2).name == "flash_attn2"
    p3 = fake_probe((8, 0), ("flash-attn",))
    assert sel.SELECTOR.select(call(window=(256, 0)), p3).name == "flash_attn2"


def test_packed_varlen_goes_to_cudnn_ragged_when_the_frontend_is_installed():
    """Measured on the H200: cuDNN's ragged kernel 0.47x padded, bucketed SDPA cuDNN 0.66x (docs/results)."""
    p = fake_probe((9, 0), ("cudnn-frontend", "xformers"))
    pick = lambda **kw: sel.SELECTOR.select(call(varlen=True, **kw), p).name  # noqa: E731
    assert pick(lengths_q=(3, 4), lengths_k=(3, 4)) == "cudnn_ragged"
    assert pick(lengths_q=(3, 4), lengths_k=(5, 4)) == "cudnn_ragged"  # bottom-right causal per sequence
    assert pick(lengths_q=(3, 4), lengths_k=(3, 4), dtype="float32") != "cudnn_ragged"
    # cuDNN's ragged graphs stop at D128: torch's native varlen kernel next (D <= 256), ahead of the bucketed route
    assert pick(lengths_q=(3,), lengths_k=(3,), head_dim=256, head_dim_v=256) == "torch_varlen"
    why = sel.explain(call(varlen=True, lengths_q=(3,), lengths_k=(3,)), fake_probe((8, 0), ("cudnn-frontend",)))
    assert why["cudnn_ragged"] == ["needs compute capability >= 9.0, GPU is sm80"]
    old = sel.explain(call(varlen=True, lengths_q=(3,), lengths_k=(3,)), fake_probe((9, 0), ("cudnn-frontend",), 90100))
    assert old["cudnn_ragged"] == ["needs cuDNN >= 90500 for ragged attention (torch has 90100)"]
    assert sel.explain(call(varlen=True, lengths_q=(3,), lengths_k=(3,)), fake_probe((9, 0)))["cudnn_ragged"] == [
        "cudnn-frontend is not installed"]


def test_cudnn_ragged_graph_keys_and_keyless_rows():
    from attnkit.runtime.backends.cudnn_ragged import keyless_rows, round_seqlen

    assert [round_seqlen(n) for n in (1, 64, 65, 3000, 4096, 4097)] == [64, 64, 128, 4096, 4096, 8192]
    # packed rows [0..20) [20..25) [25..55) [55..62): no keys in sequence 1; sequence 0 has 12 more queries
    # than keys, sequence 3 none (bottom-right causal)
    assert keyless_rows((20, 5, 30, 7), (8, 0, 30, 12), causal=True) == [*range(0, 12), *range(20, 25)]
    assert keyless_rows((20, 5, 30, 7), (8, 0, 30, 12), causal=False) == list(range(20, 25))
    assert keyless_rows((3, 4), (3, 4), causal=True) == []


def test_xformers_varlen_causal_needs_keys_for_every_query():
    """xformers' block-diagonal bottom-right mask raises when a sequence has more queries than keys."""
    p = fake_probe((7, 0), ("xformers",))
    more_q = sel.explain(call(varlen=True, lengths_q=(20, 5), lengths_k=(8, 30)), p, ["xformers"])["xformers"]
    assert more_q == ["varlen causal only when every sequence has at least as many keys as queries"]
    assert sel.explain(call(varlen=True, lengths_q=(8, 5), lengths_k=(20, 30)), p, ["xformers"])["xformers"] == []
    assert sel.explain(call(varlen=True, causal=False, lengths_q=(20,), lengths_k=(8,)), p, ["xformers"]) == {
        "xformers": []}


def test_cpu_selection():
    p = fake_probe(None)
    assert sel.SELECTOR.select(call(device="cpu"), p).name == "sdpa_cpu"
    assert sel.SELECTOR.select(call(device="cpu", alibi=True), p).name == "sdpa"
    assert sel.SELECTOR.select(call(device="cpu", softcap=True), p).name == "sdpa_math"


def test_no_backend_lists_every_backend_and_reason():
    p = fake_probe((9, 0))
    with pytest.raises(sel.NoBackendError) as ei:
        sel.SELECTOR.select(call(dtype="float64", device="mps"), p)
    msg = str(ei.value)
    for name in REGISTRY:
        assert f"  {name}: " in msg
    assert "flash-attn is not installed" in msg and "dtype float64 not supported" in msg
    assert "runs on cuda, not mps" in msg and len(msg.splitlines()) == 2 + len(REGISTRY)
    assert msg.splitlines()[-1] == "  (order decided by default: mps order)"


def test_explicit_backend_fails_loudly_with_reasons(monkeypatch):
    p = fake_probe((8, 0))
    with pytest.raises(sel.NoBackendError, match=r"(?s)backend=sdpa_cudnn cannot serve.*compute capability >= 9.0"):
        sel.SELECTOR.select(call(), p, backend="sdpa_cudnn")
    with pytest.raises(ValueError, match=r"backend: unknown backend 'flash'; known: sdpa_cudnn"):
        sel.SELECTOR.select(call(), p, backend="flash")
    monkeypatch.setenv(sel.ENV_BACKEND, "sdpa_efficient")
    sel.SELECTOR.reset()
    assert sel.SELECTOR.select(call(), p).name == "sdpa_efficient"
    monkeypatch.setenv(sel.ENV_BACKEND, "flash_attn2")
    sel.SELECTOR.reset()
    with pytest.raises(sel.NoBackendError, match=r"(?s)ATTNKIT_BACKEND=flash_attn2 cannot serve.*not installed"):
        sel.SELECTOR.select(call(), p)


def test_limits_to_reasons_is_one_function():
    lim = Limits(min_capability=(8, 0), dtypes=frozenset({"float16"}), max_head_dim=64, head_dim_multiple=32)
    r = reasons(lim, call(head_dim=80, head_dim_v=80), (7, 5))
    assert r == ["needs compute capability >= 8.0, GPU is sm75", "dtype bfloat16 not supported (supports float16)",
                 "head_dim 80 > 64", "head_dim must be a multiple of 32"]
    assert reasons(Limits(), call(), (9, 0)) == []


def test_runtime_fallback_demotes_once_and_warns(monkeypatch):
    import torch

    import attnkit
    from attnkit.runtime import dispatch

    class Exploding(Backend):
        name = "sdpa_cpu"
        limits = REGISTRY["sdpa_cpu"].limits
        calls = 0

        def compute(self, q, k, v, c, p):
            Exploding.calls += 1
            raise RuntimeError("No execution plans support the graph.")

    monkeypatch.setitem(REGISTRY, "sdpa_cpu", Exploding())
    dispatch.invalidate()
    q = torch.randn(1, 8, 2, 16)
    with pytest.warns(RuntimeWarning, match="backend sdpa_cpu failed at run time.*No execution plans"):
        out = attnkit.attention(q, q, q, causal=True)
    ref = attnkit.attention(q, q, q, causal=True, backend="sdpa_math")
    torch.testing.assert_close(out, ref)
    assert Exploding.calls == 1
    for _ in range(3):  # remembered: the failing backend is not tried again for this bucket
        attnkit.attention(q, q, q, causal=True)
    assert Exploding.calls == 1
    dispatch.invalidate()


def test_explicit_backend_does_not_fall_back(monkeypatch):
    import torch

    import attnkit
    from attnkit.runtime import dispatch

    class Exploding(Backend):
        name = "sdpa_cpu"
        limits = REGISTRY["sdpa_cpu"].limits

        def compute(self, q, k, v, c, p):
            raise RuntimeError("boom")

    monkeypatch.setitem(REGISTRY, "sdpa_cpu", Exploding())
    dispatch.invalidate()
    with pytest.raises(RuntimeError, match="boom"):
        attnkit.attention(torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8),
                          backend="sdpa_cpu")
    dispatch.invalidate()


def test_autotune_picks_fastest_and_persists(tmp_path):
    p = fake_probe((9, 0), ("flash-attn",))
    sel.SELECTOR.autotune = True
    speeds = {"sdpa_cudnn": 3.0, "flash_attn2": 1.0, "sdpa_flash": 2.0, "sdpa": 4.0, "sdpa_efficient": 5.0,
              "flex": 6.0, "sdpa_math": 9.0}
    timed: list[str] = []

    def timer(b):
        timed.append(b.name)
        return speeds[b.name]

    assert sel.SELECTOR.select(call(), p, timer=timer).name == "flash_attn2"
    assert set(timed) == set(speeds)
    timed.clear()
    assert sel.SELECTOR.select(call(batch=7), p, timer=timer).name == "flash_attn2"  # same bucket
    assert timed == []
    cache = json.loads((tmp_path / "cache" / "autotune.json").read_text())
    assert list(cache.values()) == ["flash_attn2"]
    assert "Fake sm90" in next(iter(cache)) and "flash-attn=1.0" in next(iter(cache))
    # a new process reads the disk cache
    sel.SELECTOR.reset()
    sel.SELECTOR.autotune = True
    assert sel.SELECTOR.select(call(), p, timer=lambda b: pytest.fail("re-timed")).name == "flash_attn2"
    # another GPU does not reuse it
    other = fake_probe((9, 0), ("flash-attn",))
    other = replace(other, gpus=(GPU(0, "Other", (9, 0), 1, 1),))
    assert sel.SELECTOR.select(call(), other, timer=timer).name == "flash_attn2"
    assert timed  # re-timed for the other GPU


# -- FlashAttention-4: limits per architecture, and selection per call class ---------------------------------------

def test_flash_attn4_limits_per_architecture():
    fa4 = REGISTRY["flash_attn4"]
    why = lambda cc, **kw: reasons(fa4.limits, call(**kw), cc)  # noqa: E731
    assert why((9, 0)) == [] and why((9, 0), head_dim=256, head_dim_v=256) == []
    assert why((9, 0), head_dim=512, head_dim_v=512) == ["head_dim 512 > 256"]
    assert why((9, 0), head_dim=100, head_dim_v=100) == ["head_dim must be a multiple of 8"]
    assert why((10, 0), head_dim=192, head_dim_v=192) == ["head_dim 192 > 128 (or exactly 256)"]
    assert why((10, 0), head_dim=256, head_dim_v=256) == [] and why((11, 0)) == []
    assert why((12, 0), head_dim=256, head_dim_v=256) == ["head_dim 256 > 128"]
    assert why((12, 0), deterministic=True) == [
        "backward is not deterministic (torch.use_deterministic_algorithms is on)"]
    assert why((9, 0), deterministic=True) == []
    assert why((8, 0)) == ["has kernels for compute capability 9.0, 10.0-11.9, 12.0-12.9, GPU is sm80"]
    assert why((9, 0), dtype="float32", dropout=True, alibi=True) == [
        "dtype float32 not supported (supports bfloat16, float16)", "no ALiBi support", "no dropout support"]
    assert why((9, 0), window=(128, 0), softcap=True, varlen=True, lengths_q=(3,), lengths_k=(9,)) == []
    assert why((9, 0), head_dim_v=64) == ["needs v's head_dim equal to q's"]


@pytest.mark.parametrize(
    ("label", "kw", "expected"),
    [
        ("train D128 bf16", {}, "flash_attn4"),
        ("train D128 fp16", {"dtype": "float16"}, "flash_attn4"),
        ("inference D128", {"requires_grad": False}, "sdpa_cudnn"),
        ("train D256", {"head_dim": 256, "head_dim_v": 256}, "sdpa_cudnn"),
        ("train D64", {"head_dim": 64, "head_dim_v": 64}, "flash_attn4"),
        ("train D128 short", {"batch": 2, "seqlen_q": 2048, "seqlen_k": 2048}, "sdpa_cudnn"),
        ("long forward D128", {"requires_grad": False, "heads": 32, "kv_heads": 8}, "flash_attn4"),
        ("window", {"window": (1024, 0)}, "flash_attn4"),
        ("varlen", {"varlen": True, "lengths_q": (100, 7), "lengths_k": (100, 7)}, "flash_attn4"),
        ("chunked prefill", {"seqlen_q": 512, "requires_grad": False}, "flash_attn4"),
        ("decode", {"seqlen_q": 1, "causal": False, "requires_grad": False, "batch": 64}, "sdpa"),
        ("windowed decode", {"seqlen_q": 1, "causal": False, "requires_grad": False, "batch": 64,
                             "window": (4096, 0)}, "flash_attn4"),
        ("ALiBi train", {"alibi": True}, "flex"),
        ("ALiBi forward", {"alibi": True, "requires_grad": False}, "flex"),
        ("spec decode", {"seqlen_q": 4, "requires_grad": False, "batch": 16, "heads": 32, "kv_heads": 8}, "flash_attn4"),
        ("tiny chunk", {"seqlen_q": 4, "seqlen_k": 256, "requires_grad": False, "batch": 1}, "sdpa"),
        ("varlen short", {"varlen": True, "seqlen_q": 64, "seqlen_k": 64, "batch": 256, "head_dim": 64,
                          "head_dim_v": 64, "lengths_q": (64, 1), "lengths_k": (64, 1)}, "torch_varlen"),
        ("small", {"batch": 4, "seqlen_q": 256, "seqlen_k": 256, "head_dim": 64, "head_dim_v": 64}, "sdpa"),
        ("fp32", {"dtype": "float32"}, "sdpa_efficient"),
        ("cross", {"seqlen_q": 4096, "seqlen_k": 512, "causal": False, "requires_grad": False}, "sdpa_cudnn"),
    ],
)
def test_selection_per_call_class_on_h200_with_fa4(label, kw, expected):
    p = fake_probe((9, 0), ("flash-attn-4", "cudnn-frontend"))
    assert sel.SELECTOR.select(call(**kw), p).name == expected, label


def test_rows_without_fa4_fall_back_to_the_measured_next_choice():
    p = fake_probe((9, 0), ("cudnn-frontend",))
    pick = lambda **kw: sel.SELECTOR.select(call(**kw), p).name  # noqa: E731
    assert pick(window=(1024, 0)) == "sdpa_cudnn"
    assert pick(varlen=True, lengths_q=(100, 7), lengths_k=(100, 7)) == "cudnn_ragged"
    assert pick(seqlen_q=512, requires_grad=False) == "sdpa"  # torch's native bottom-right flash kernel
    assert pick() == "sdpa_cudnn"


def test_a_small_windowed_forward_goes_to_fa4_and_small_windowed_training_to_the_plain_call():
    """'small windowed forward' takes from 'small' the half-precision windowed forwards (the sweep: FA4 1.6-15x faster
    than the plain call on each); training stays on 'small' (FA4 lost each such fwd+bwd pass), and so do calls the
    row does not measure: ALiBi, float32, packed, decode, and chunked prefill above its own row's bound."""
    from attnkit.runtime import priority

    p = fake_probe((9, 0), ("flash-attn-4", "cudnn-frontend"))
    label = lambda c: priority.order_for(c, (9, 0))[1].label  # noqa: E731
    small = {"batch": 1, "seqlen_q": 1024, "seqlen_k": 1024, "head_dim": 64, "head_dim_v": 64, "window": (64, 64),
             "causal": False}
    fwd, train = call(**small, requires_grad=False), call(**small)
    assert fwd.work < priority.SMALL_WORK
    assert label(fwd) == "small windowed forward" and sel.SELECTOR.select(fwd, p).name == "flash_attn4"
    assert label(train) == "small" and sel.SELECTOR.select(train, p).name == "sdpa"
    # without FA4 the plain call serves it, as under 'small' before the row
    assert sel.SELECTOR.select(fwd, fake_probe((9, 0), ("cudnn-frontend",))).name == "sdpa"
    # a causal chunk below the chunked-prefill row's bound is the row's; above it, that row's (FA4 first too)
    chunk = replace(fwd, seqlen_q=256, seqlen_k=1024, causal=True, window=(64, 0))
    assert chunk.work < priority.FA4_PREFILL_WORK and label(chunk) == "small windowed forward"
    big_chunk = replace(chunk, batch=8)
    assert big_chunk.work >= priority.FA4_PREFILL_WORK
    assert label(big_chunk) == "chunked prefill and speculative decoding"
    assert label(replace(fwd, seqlen_q=1, seqlen_k=4096, causal=False)) == "windowed decode"
    assert label(replace(fwd, alibi=True)) == "small"  # FA4 has no ALiBi: left where it was
    f32 = replace(fwd, dtype="float32")  # FA4 cannot serve it: the 'sliding window' row, as before
    assert label(f32) == "sliding window"
    assert label(replace(fwd, varlen=True, lengths_q=(1024,), lengths_k=(1024,))).startswith("packed varlen")


def test_blackwell_rows_and_defaults():
    p = fake_probe((10, 0), ("flash-attn-4",))
    assert sel.SELECTOR.select(call(window=(1024, 0)), p).name == "flash_attn4"
    assert sel.SELECTOR.select(call(), p).name == "sdpa_cudnn"  # not measured: cuDNN stays first


def test_priority_rows_are_data_with_sources_and_never_drop_a_backend():
    from attnkit.runtime import priority

    for minimum, order in priority.DEFAULTS:
        assert set(order) <= set(REGISTRY), minimum
    for row in priority.ROWS:
        assert set(row.order) <= set(REGISTRY), row.label
        assert row.source and row.when, row.label
        assert set(row.when) <= set(priority.Features.__dataclass_fields__), row.label
        assert row.matches(priority.features(call()), row.arch[0]) in (True, False)
    for kw in ({}, {"window": (9, 0)}, {"seqlen_q": 1}, {"varlen": True, "lengths_q": (3,), "lengths_k": (3,)}):
        order, _ = priority.order_for(call(**kw), (9, 0))
        assert sorted(order) == sorted(priority.default_order(call(), (9, 0))), kw
        assert len(order) == len(set(order))


def test_explicit_backend_still_fails_loudly_where_its_row_does_not_apply():
    p = fake_probe((9, 0), ("flash-attn-4",))
    with pytest.raises(sel.NoBackendError, match=r"(?s)backend=flash_attn4 cannot serve.*no ALiBi support"):
        sel.SELECTOR.select(call(alibi=True), p, backend="flash_attn4")


def test_flash_attn4_is_found_without_importing_it_and_a_failed_import_is_remembered(tmp_path, monkeypatch):
    """The probe finds flash-attn-4 from its distribution's files (its import costs ~4.6 s); the first use
    imports it; an import that fails makes the backend unavailable with that error, and is not retried."""
    import importlib
    import sys

    from attnkit.runtime import loaders
    from attnkit.runtime import probe as probe_mod

    site = tmp_path / "site"
    (site / "flash_attn" / "cute").mkdir(parents=True)
    (site / "flash_attn" / "cute" / "__init__.py").write_text("raise ImportError('libcute_dsl_runtime.so: cannot open')\n")
    info = site / "flash_attn_4-4.0.0b36.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn-4\nVersion: 4.0.0b36\n")
    (info / "RECORD").write_text("")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setattr(loaders, "FA4_STATE", {})
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(loaders.FA4_CACHE_DIR, raising=False)
    monkeypatch.delenv(loaders.FA4_CACHE_ENABLED, raising=False)

    libs = {lib.name: lib for lib in probe_mod._libraries(with_torch=True)}
    fa4 = libs["flash-attn-4"]
    assert (fa4.installed, fa4.checked, fa4.version) == (True, False, "4.0.0b36")
    assert "flash_attn.cute" not in sys.modules
    p = replace(fake_probe((9, 0)), libraries=tuple(libs.values()))
    backend = REGISTRY["flash_attn4"]
    assert backend.check(call(), p) == []  # provisionally available: nothing imported yet
    with pytest.raises(RuntimeError, match=r"flash_attn\.cute does not import: ImportError: libcute_dsl_runtime\.so"):
        loaders.load_fa4()
    # the kernel cache was pointed into attnkit's cache folder before the import
    assert loaders.fa4_kernel_cache_dir() == tmp_path / "cache" / "flash-attn-4"
    assert backend.check(call(), p) == ["flash_attn.cute does not import: ImportError: libcute_dsl_runtime.so: cannot open"]
    (site / "flash_attn" / "cute" / "__init__.py").write_text("")  # fixed on disk: still not retried this process
    with pytest.raises(RuntimeError, match="does not import"):
        loaders.load_fa4()
    assert sel.SELECTOR.select(call(window=(64, 0)), p).name == "sdpa_cudnn"
    for name in ("flash_attn.cute", "flash_attn"):
        sys.modules.pop(name, None)


def test_flash_attn4_cache_respects_the_users_own_variables(tmp_path, monkeypatch):
    from attnkit.runtime import loaders

    monkeypatch.setenv(loaders.FA4_CACHE_DIR, str(tmp_path / "mine"))
    assert loaders.fa4_kernel_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(loaders.FA4_CACHE_ENABLED, "0")
    assert loaders.fa4_kernel_cache_dir() is None


def test_fallback_blocks_nest_and_belong_to_their_thread():
    import threading

    c = call()
    with sel.SELECTOR.fallbacks() as outer:
        with sel.SELECTOR.fallbacks() as inner:  # equal (empty) lists: each must stay its own block
            pass
        sel.SELECTOR.demote("sdpa_cudnn", c, RuntimeError("boom"))
        with sel.SELECTOR.fallbacks() as again:
            sel.SELECTOR.demote("flash_attn4", c, RuntimeError("bang"))
        other: list[list[str]] = []
        t = threading.Thread(target=lambda: sel.SELECTOR.demote("sdpa_flash", c, RuntimeError("elsewhere")))
        with sel.SELECTOR.fallbacks() as mine:
            t.start()
            t.join()
            other.append(mine)
    assert inner == []
    assert outer == ["sdpa_cudnn: RuntimeError: boom", "flash_attn4: RuntimeError: bang"]
    assert again == ["flash_attn4: RuntimeError: bang"]
    assert other == [[]]  # another thread's demotion is not this block's


@pytest.mark.parametrize("error", ["CUDA out of memory. Tried to allocate 2.00 GiB.",
                                   "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"])
def test_out_of_memory_is_raised_as_it_is_and_demotes_nothing(monkeypatch, error):
    """An OOM is memory pressure, not a broken kernel: attention() raises torch's own error (a batch-size finder
    catches it), warns nothing, demotes nothing; once memory is there again, the same backend serves the call."""
    import warnings

    import torch

    import attnkit
    from attnkit.runtime import dispatch

    class Tight(Backend):
        name = "sdpa_cpu"
        limits = REGISTRY["sdpa_cpu"].limits
        full = True
        calls = 0

        def compute(self, q, k, v, c, p):
            Tight.calls += 1
            if Tight.full:
                raise (torch.OutOfMemoryError if "CUDA" in error else RuntimeError)(error)
            return q * 1.0

    monkeypatch.setitem(REGISTRY, "sdpa_cpu", Tight())
    dispatch.invalidate()
    q = torch.randn(1, 8, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=re.escape(error)):  # a first call: selection, binding, the run
            attnkit.attention(q, q, q, causal=True)
        Tight.full = False
        torch.testing.assert_close(attnkit.attention(q, q, q, causal=True), q)  # bound now
        Tight.full = True
        with pytest.raises(RuntimeError, match=re.escape(error)):  # the bound call's own path
            attnkit.attention(q, q, q, causal=True)
        assert sel.SELECTOR.demoted == {}
        Tight.full = False
        torch.testing.assert_close(attnkit.attention(q, q, q, causal=True), q)
    assert Tight.calls == 4
    dispatch.invalidate()


def test_alibi_rows_take_large_causal_chunks_from_chunked_prefill():
    """FA4 has no ALiBi, so 'chunked prefill' handed large causal ALiBi chunks to the plain call with a dense bias;
    the ALiBi rows (flex) stand ahead of it from SMALL_WORK (the sweep: flex 1.17-5.9x faster on 4 of 6 such calls).
    Smaller ALiBi calls, and ALiBi decode (windowed or not, at any work), stay where they were."""
    from attnkit.runtime import priority

    p = fake_probe((9, 0), ("flash-attn-4", "cudnn-frontend"))
    label = lambda c: priority.order_for(c, (9, 0))[1].label  # noqa: E731
    chunk = call(batch=8, seqlen_q=512, seqlen_k=4096, heads=32, kv_heads=8, head_dim=128, causal=True, alibi=True)
    assert chunk.work >= priority.SMALL_WORK
    assert label(chunk) == "ALiBi training" and sel.SELECTOR.select(chunk, p).name == "flex"
    fwd = replace(chunk, requires_grad=False)
    assert label(fwd) == "ALiBi forward" and sel.SELECTOR.select(fwd, p).name == "flex"
    # the same chunk without ALiBi is still the chunked-prefill row's (FA4 first)
    assert label(replace(chunk, alibi=False)) == "chunked prefill and speculative decoding"
    # below SMALL_WORK: 'chunked prefill' from FA4_PREFILL_WORK (FA4 cannot serve ALiBi: the plain call), else 'small'
    band = replace(chunk, batch=1, seqlen_q=256)
    assert priority.FA4_PREFILL_WORK <= band.work < priority.SMALL_WORK
    assert label(band) == "chunked prefill and speculative decoding" and sel.SELECTOR.select(band, p).name == "sdpa"
    small = replace(chunk, batch=1, seqlen_q=64, seqlen_k=1024)
    assert small.work < priority.FA4_PREFILL_WORK
    assert label(small) == "small" and sel.SELECTOR.select(small, p).name == "sdpa"
    # decode above SMALL_WORK too: 'decode', and windowed 'windowed decode', as before
    decode = replace(chunk, batch=64, seqlen_q=1, seqlen_k=32768, causal=False, requires_grad=False)
    assert decode.work >= priority.SMALL_WORK
    assert label(decode) == "decode"
    assert label(replace(decode, window=(1024, 0))) == "windowed decode"


def _one_point_table(tmp_path, monkeypatch, *points: dict) -> None:
    cell = {"schema": table.SCHEMA, "arch": "sm90", "cells": {"fwd|bfloat16|causal|gqa|chunk|-|-|alibi|no": list(points)}}
    (tmp_path / "t").mkdir(exist_ok=True)
    (tmp_path / "t" / "sm90.json").write_text(json.dumps(cell))
    monkeypatch.setenv(table.ENV_TABLES, str(tmp_path / "t"))
    table.load.cache_clear()


def test_in_a_compiled_graph_half_precision_alibi_goes_to_the_backends_that_take_the_slopes(tmp_path, monkeypatch):
    """Rule 5 (select.graph_alibi_order): a table point ranks `sdpa` first for this forward (GQA ALiBi chunk, 2^37),
    timed with its dense bias built once; a graph builds that bias on every call (1.47x sdpa's eager time there,
    H100 2026-12-07), so traced by torch.compile it goes to flex, measured correct at that point, and the decision
    says why. Eagerly, in float32 (flex's float32 kernels are 20-500x slower from D128 up), on the CPU, without ALiBi
    and under torch.jit.trace the order is the measured one."""
    _one_point_table(tmp_path, monkeypatch, {"head_dim": 128, "log2_work": 37.0, "order": ["sdpa", "sdpa_cudnn", "flex"]})
    p = fake_probe((9, 0), ("flash-attn-4",))
    chunk = call(batch=1, heads=32, kv_heads=8, seqlen_q=2048, seqlen_k=16384, alibi=True, requires_grad=False)
    assert sel.SELECTOR.select(chunk, p).name == "sdpa"
    order, decided = sel.decided_order(replace(chunk, trace="compile"), p)
    assert sel.SELECTOR.select(replace(chunk, trace="compile"), p).name == "flex"
    assert order[:3] == ("flex", "sdpa", "sdpa_cudnn") and "rule 5" in decided.describe()
    for other in (replace(chunk, dtype="float32", trace="compile"), replace(chunk, trace="compile", device="cpu"),
                  replace(chunk, alibi=False, trace="compile"), replace(chunk, trace="jit"), chunk):
        assert sel.decided_order(other, p) == sel.decided_order(replace(other, trace=""), p)
    # the limits say which backends build the bias: every one that serves ALiBi and is not flex or flash-attn 2
    takes_slopes = {n for n, b in REGISTRY.items() if _limits_of(n).alibi and not _limits_of(n).alibi_bias}
    assert takes_slopes == {"flex", "flex_flash", "flash_attn2"}


def test_rule_5_does_not_move_a_backend_the_deciding_table_point_did_not_find_correct(tmp_path, monkeypatch):
    """A table point's order leaves out what raised or answered wrongly there (flex raised on a D64 ALiBi decode point
    of the 784-case table): in a graph that backend stays where the default order puts it, behind `sdpa`; also when
    another near point, blended in, timed it (the nearest point's own order is the one trusted)."""
    p = fake_probe((9, 0), ("flash-attn-4",))
    chunk = call(batch=1, heads=32, kv_heads=8, seqlen_q=2048, seqlen_k=16384, alibi=True, requires_grad=False,
                 trace="compile")
    without = {"head_dim": 128, "log2_work": 37.0, "order": ["sdpa", "sdpa_cudnn"],
               "scores": {"sdpa": 1.0, "sdpa_cudnn": 1.01}}
    timed = {"head_dim": 128, "log2_work": 36.0, "order": ["sdpa", "flex", "sdpa_cudnn"],
             "scores": {"sdpa": 1.0, "flex": 1.02, "sdpa_cudnn": 1.03}}
    for points in ((without,), (without, timed)):
        _one_point_table(tmp_path, monkeypatch, *points)
        order, decided = sel.decided_order(chunk, p)
        assert order.index("sdpa") < order.index("flex") and "rule 5" not in decided.describe(), points
        assert sel.SELECTOR.select(chunk, p).name == "sdpa"
    _one_point_table(tmp_path, monkeypatch, timed)  # measured correct there: moved ahead of the dense bias
    order, decided = sel.decided_order(chunk, p)
    assert order[:3] == ("flex", "sdpa", "sdpa_cudnn") and "rule 5" in decided.describe()


def _limits_of(name: str) -> Limits:
    lim = REGISTRY[name].limits
    return lim[0].limits if isinstance(lim, tuple) else lim
