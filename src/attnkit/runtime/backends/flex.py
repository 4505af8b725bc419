"""torch's FlexAttention (`torch.nn.attention.flex_attention`, torch >= 2.5): ALiBi, softcap, windows and packed
varlen written as a score_mod / mask_mod and compiled into one fused kernel, instead of a dense bias or mask that
SDPA reads from memory. Two backends, so that measurement can tell them apart:

- `flex`: the Triton kernels inductor generates (any CUDA GPU from sm80, forward and backward).
- `flex_flash`: the same call with `kernel_options={"BACKEND": "FLASH"}`, FlashAttention-4's CuTe kernels behind
  flex (torch >= 2.11 and flash-attn-4 installed; sm90 and sm100 only). Experimental upstream, and off here
  unless opted in (FLASH_BROKEN says why).

Measured on the H200 (docs/results/2026-12-01-h200-flex-alibi.json; ALiBi causal B8 S2048 H16 D128 bf16): forward back to back
flex FLASH 0.45 ms, flex Triton 0.49 ms, SDPA with a bias built once 0.92 ms; fwd+bwd 2.36 / 2.08 / 3.49 ms. flex
is slow where FA4 is native (softcap + window at D256: 50 ms vs 1.7 ms; windowed decode 25 ms vs 0.48 ms), which
is why selection (measured tables, else runtime/priority.py) and not these limits decides where it runs.
FA4's own score_mod route for ALiBi is what flex FLASH runs (FA4's CuTe kernels with the score_mod compiled in), and
it measured slower than `flex` (H100, 2026-12-06, the BLOOM ALiBi held-out shape B2 S2048 H32 D128 bf16, raced side by
side in docs/results/2026-12-06-h100-tune-validate-session23-alibi-softcap-with-flex-flash.json): forward with a sync
/ back to back 0.574 / 0.278 ms against 0.375 / 0.262, fwd+bwd 1.683 / 1.095 against 1.188 / 0.949. ALiBi stays here.

The first call of a signature compiles (2-6 s on the H200): `attnkit warmup` pays it outside a timed step, and
inductor's own disk cache keeps the kernels across processes. The compiled function is torch's documented
`torch.compile(flex_attention)` (`_compiled`), made for each of a signature's first STATIC_SIZES sizes with
dynamic=False (`entry_point`): the kernel compiled for its lengths ran 1.3-1.8x faster with ALiBi than the dynamic
graph that automatic dynamic shapes make of a second length (H100, 2026-12-07). Later sizes (a decode loop's growing
cache) and packed calls share one entry per signature, which turns a second length into one dynamic graph rather
than a compile per length (checked on the CPU: new score_mod closures of one signature add no compile; a second
length adds one, then none). The block mask (which
key blocks a query block visits) depends on the lengths only: it is built by the bound call's first run, once per
signature (per cu_seqlens for varlen), so that a failure there falls back as a kernel's would.
On CPU the call runs flex's unfused reference path (the same semantics, not fast): only when asked for by name.
Under torch.compile / torch.export, flex_attention is recorded as the higher-order op it is, with its backward
where the graph's sizes are static and the call is not packed varlen (GRAPH_GRAD, below, says why not there).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, ClassVar

from packaging.version import Version

from attnkit.runtime import loaders
from attnkit.runtime.backends.base import ArchLimits, Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params

MIN_TORCH = Version("2.5")  # torch.nn.attention.flex_attention appeared in 2.5
MIN_TORCH_FLASH = Version("2.11")  # kernel_options BACKEND="FLASH" (flex on FlashAttention-4's CuTe kernels)
# flex's FLASH backend raised on 216 of 461 cases of flash-attn's test grid on the H200 (torch 2.11.0, FA4
# 4.0.0b36; docs/results/2026-12-01-h200-oracle-flex.json): "NYI: score_mod or mask_mod captures a dynamic
# scalar", "Block sparsity requires sparse_block_size[1] to be a multiple of tile_n=80" (D256), an Int64/Int32
# store mismatch on document masks, and backward "compiled with non-empty donated buffers". Raising is not wrong
# (nothing answered wrongly), but a backend that raises on half of the calls it claims is not one to select:
# off unless asked for, until a torch release passes that grid.
OPT_IN_FLASH = "ATTNKIT_EXPERIMENTAL_FLEX_FLASH"
FLASH_BROKEN = (f"flex's FLASH backend raises on masks, score mods and backward on torch 2.11 (flash-attn's "
                f"test grid, H200); opt in with {OPT_IN_FLASH}=1")

# flex's frontend, called inside attnkit's graph call (a nonstrict_trace function, run on fake tensors), compiles
# its op once more (torch.compile of flex's HOP wrapper); with a backward and sizes the graph keeps dynamic that
# nested compile fails ("PendingUnbackedSymbolNotFound", reported by dynamo as "Unsupported output type for
# nonstrict_trace-ed function"): the H200 smoke's compiled softcap float32 row (dynamic=True, torch 2.11.0;
# docs/results/2026-12-01-h200-smoke-session3.json), and ALiBi and softcap on the CPU (torch 2.13, with torch's
# CPU refusal lifted). With static sizes it records forward and backward: on the H100 (torch 2.11.0,
# docs/results/2026-12-07-h100-flex-compiled-grad-session28.json) ALiBi, softcap, a window and a causal chunk, in
# bf16 / fp16 / fp32, ran flex's kernels with gradients equal to eager flex's, and inductor's lowering of a packed
# varlen (document mask) backward raised "NotImplementedError: SliceView". So a backward in a graph is refused
# where sizes are dynamic, and for packed varlen: such a call goes to a backend that records one, and a model
# compiled with static sizes (torch.compile's default for a first size) keeps eager's flex kernels in training.
GRAPH_GRAD = ("its backward is not recorded inside attnkit's torch.compile call when the graph's sizes are "
              "dynamic (flex's own nested compile fails on them); static sizes record it")
# torch.compile(dynamic=True) of attnkit's graph call: on the CPU (torch 2.13) flex's forward failed in inductor in 4
# of 4 cases, also with every size marked static ("A subgraph argument other than striding has been modified;
# FakeTensorUpdater cannot update this argument"), while the same graph compiled with dynamic=None passed at two
# sizes (its second compile keeps the changed sizes dynamic); torch's own flex_attention under dynamic=True failed to
# build its CPU kernel at those sizes too, so the CPU does not say whose failure it is
# (tools/probe-flex-graph-dynamic.py, docs/results/2026-12-07-dev-cpu-flex-graph-dynamic-session29.json). On the H100
# (torch 2.11) the forward failed too, ALiBi chunk GQA 8/2 D128, at both sizes and with every size marked static
# ("LoweringException: TypeError: unsupported operand type(s) for &: 'floor' and 'Add'"), while dynamic=None matched
# eager flex, and torch's own flex_attention with a causal mask alone under dynamic=True ran
# (docs/results/2026-12-07-h100-flex-graph-dynamic-session30.json; 1 of the probe's 4 cases). The H200's one try (a
# backward) failed: flex stays out of such graphs, whichever torch.compile backend, and they go to a backend that
# records them (a dense mask or bias in the graph) rather than to a compile error with no fallback
GRAPH_DYNAMIC = ("not recorded inside attnkit's torch.compile call compiled with dynamic=True (flex's forward failed "
                 "in inductor there, H100 and CPU); dynamic=None keeps it")
GRAPH_GRAD_VARLEN = ("its backward for packed varlen (a document mask) fails in inductor's lowering under "
                     "torch.compile on this torch ('NotImplementedError: SliceView', H100, torch 2.11)")

# traces: flex_attention is torch's own higher-order op, which torch.compile / torch.export record as it is
_TRITON = Limits(devices=frozenset({"cuda", "cpu"}), min_capability=(8, 0),
                 dtypes=frozenset({"float16", "bfloat16", "float32"}), max_head_dim=256, head_dim_multiple=8,
                 head_dim_v_differs=True, gqa="native", varlen="native", window=True, alibi=True, softcap=True,
                 traces=frozenset({"compile"}))
# FA4 behind flex: FA4's own dtypes and head dims (runtime/backends/flash_attn4.py), on the two architectures
# torch's flex FLASH path targets
_FLASH = Limits(dtypes=frozenset({"float16", "bfloat16"}), max_head_dim=256, head_dim_multiple=8, gqa="native",
                varlen="native", window=True, alibi=True, softcap=True, traces=frozenset({"compile"}))


@functools.cache
def _flex() -> tuple[Any, Any]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


def _entry(q: Any, k: Any, v: Any, block_mask: Any, kw: dict[str, Any]) -> Any:
    """The body of every compiled entry point; `_flex_attention` is bound in each one's own globals."""
    return _flex_attention(q, k, v, block_mask=block_mask, **kw)  # type: ignore[name-defined]  # noqa: F821


@functools.cache
def _compiled(signature: tuple[Any, ...], static: bool = False) -> Any:
    """torch.compile of flex_attention, one entry point (its own code object) per call signature. dynamo keeps
    at most `recompile_limit` (8) graphs per code object; past that it runs the function uncompiled, and flex's
    uncompiled path failed every score_mod call on the H200 ("RuntimeError when making fake tensor call": the
    smoke's ALiBi and softcap rows, after a dozen other flex signatures in one process). `static`: compiled for
    one size (dynamic=False; `entry_point` puts the size into the signature); else dynamo's automatic dynamic
    shapes make a second size a dynamic graph, so sizes do not multiply graphs."""
    import types

    import torch

    code = _entry.__code__.replace(co_name=f"flex_attention_{len(_SIGNATURES)}")
    _SIGNATURES.append(signature)
    scope = {**_entry.__globals__, "_flex_attention": _flex()[0]}
    return torch.compile(types.FunctionType(code, scope, code.co_name), dynamic=False if static else None)


_SIGNATURES: list[tuple[Any, ...]] = []  # the compiled entry points' signatures, in the order they were made

# Sizes of one signature compiled each for itself. flex's kernel in a dynamic graph (a second size through one
# entry point) ran 1.29-1.84x the time of the same call compiled for its size with ALiBi, and 1.07x with a causal
# mask alone (H100, 2026-12-07: docs/results/2026-12-07-h100-flex-first-size-session30.json). So the first
# STATIC_SIZES sizes of a signature get an entry point each; later ones share one that dynamo makes dynamic, so a
# loop over ever new sizes (training with padding to each batch's longest) compiles at most STATIC_SIZES + 2 times,
# not once a size. Queries shorter than DECODE_MAX_Q (decode, speculative: a growing cache makes every step a new
# size, and nothing measured the static kernel there) take the shared entry from the start.
STATIC_SIZES = 4
_STATIC = {"sizes": STATIC_SIZES}
_SIZES: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}


def entry_point(signature: tuple[Any, ...], sizes: tuple[Any, ...] | None) -> Any:
    """The compiled flex for a call of `signature` with these sizes (and the values its mods close over, which a
    static graph fixes too). None, and every size past a signature's first STATIC_SIZES: the shared entry point,
    dynamic from its second size on."""
    if sizes is not None:
        seen = _SIZES.setdefault(signature, set())
        if sizes in seen or len(seen) < _STATIC["sizes"]:
            seen.add(sizes)
            return _compiled((*signature, sizes), static=True)
    return _compiled(signature)


def allow_many_signatures(limit: int = 1024) -> None:
    """For processes that race hundreds of call signatures (bench, tune, oracle): past dynamo's recompile limit
    (8 per function by default) the next signature runs flex_attention uncompiled, i.e. its dense reference
    path: right, but slow and O(Sq*Sk) in memory, which would make such a harness measure the wrong thing. A
    model's process sees a handful of signatures and keeps torch's default."""
    import torch._dynamo.config as cfg

    cfg.recompile_limit = max(cfg.recompile_limit, limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * limit)


def for_measurement(limit: int = 1024) -> None:
    """allow_many_signatures, and every size of a signature compiled for itself: the bench and the sweep time many
    sizes of one signature in one process, each as the model that runs it would, which has a handful of sizes and
    so the static kernel, not the dynamic one (1.3-1.8x slower with ALiBi)."""
    allow_many_signatures(limit)
    _STATIC["sizes"] = max(_STATIC["sizes"], limit)


def _torch_version(probe: Any) -> Version:
    return Version(probe.torch.version.split("+")[0])


def mask_and_score(call: AttentionCall, p: Params, device: Any) -> tuple[Any, Any, int, int]:
    """attnkit's semantics as flex functions: (mask_mod or None, score_mod or None, Q_LEN, KV_LEN).

    Dense calls align the causal diagonal bottom-right (query i sees keys j <= i + Sk - Sq). Packed varlen runs
    as ONE sequence of all tokens with a document mask: a query sees only keys of its own sequence, each
    sequence aligned bottom-right on its own lengths. ALiBi subtracts slope * |j - diagonal(i)|, after softcap,
    as the reference (runtime/reference.py) does."""
    import torch

    window, causal = p.window, call.causal
    slopes = p.alibi_slopes
    if call.varlen:
        cq, ck = p.cu_seqlens_q.long(), p.cu_seqlens_k.long()
        q_len, kv_len = int(p.inputs.q.shape[0]), int(p.inputs.k.shape[0])
        pos = torch.arange(q_len, device=device)
        doc_q = torch.searchsorted(cq[1:], pos, right=True)
        doc_k = torch.searchsorted(ck[1:], torch.arange(kv_len, device=device), right=True)
        # each query's diagonal as an index on the packed key axis: its sequence's first key, plus its position
        # in its sequence, plus that sequence's len_k - len_q (bottom-right alignment per sequence)
        diag = ck[doc_q] + (pos - cq[doc_q]) + (ck[1:] - ck[:-1] - cq[1:] + cq[:-1])[doc_q]

        def line(qi: Any) -> Any:
            return diag[qi]

        def same_doc(qi: Any, kj: Any) -> Any:
            return doc_q[qi] == doc_k[kj]

        def slope(b: Any, h: Any, qi: Any) -> Any:
            return slopes[doc_q[qi], h] if slopes.dim() == 2 else slopes[h]
    else:
        q_len, kv_len = call.seqlen_q, call.seqlen_k
        off = kv_len - q_len

        def line(qi: Any) -> Any:
            return qi + off

        same_doc = None  # type: ignore[assignment]

        def slope(b: Any, h: Any, qi: Any) -> Any:
            return slopes[b, h] if slopes.dim() == 2 else slopes[h]

    def mask_mod(b: Any, h: Any, qi: Any, kj: Any) -> Any:
        d = line(qi)
        ok = same_doc(qi, kj) if same_doc is not None else kj >= 0
        if causal:
            ok = ok & (kj <= d)
        if window is not None and window[0] >= 0:
            ok = ok & (kj >= d - window[0])
        if window is not None and window[1] >= 0:
            ok = ok & (kj <= d + window[1])
        return ok

    if not (call.varlen or causal or window is not None):
        mask_mod = None  # type: ignore[assignment]

    cap = p.softcap if call.softcap else 0.0
    alibi = slopes is not None
    if not (cap or alibi):
        return mask_mod, None, q_len, kv_len

    def score_mod(score: Any, b: Any, h: Any, qi: Any, kj: Any) -> Any:
        if cap:
            score = cap * torch.tanh(score / cap)
        if alibi:
            score = score - slope(b, h, qi) * (kj - line(qi)).abs()
        return score
    return mask_mod, score_mod, q_len, kv_len


DECODE_MAX_Q = 128  # torch's flex lowering takes its decoding kernel for Q_LEN below this (flex_decoding.py)


def decode_options(call: AttentionCall, q_len: int) -> dict[str, Any]:
    """kernel_options that keep a short GQA query off flex's decoding kernel where that kernel cannot run.

    For Q_LEN < 128 inductor lowers flex to its decoding kernel, which puts a KV head's whole query group in one
    block: BLOCK_M = next_power_of_2(Q_LEN * group). Past 128 that block no longer divides the block mask's
    128-row blocks, every config is filtered out and the compile fails ("NoValidChoicesError: No choices to
    select"): the H200 smoke's GQA rows causal_sq_gt_sk (Sq 96, group 2), varlen (121 packed queries),
    varlen_self and window_both, in every dtype (torch 2.11.0; docs/results/2026-12-01-h200-smoke-session3.json).
    A Llama-style 32/8 group hits it from 33 queries on (speculative decoding, small prefill chunks). The main
    kernel handles any Q_LEN; FORCE_USE_FLEX_ATTENTION (torch >= 2.5) is torch's documented option for choosing
    it, and torch refuses it beside a BACKEND (flex_flash's FLASH never takes the decoding kernel anyway)."""
    group = call.heads // max(call.kv_heads, 1)
    if call.gqa and q_len < DECODE_MAX_Q and q_len * group > DECODE_MAX_Q:
        return {"FORCE_USE_FLEX_ATTENTION": True}
    return {}


class Flex(Backend):
    name = "flex"
    compiles = True
    limits: Limits | tuple[ArchLimits, ...] = _TRITON
    kernel_options: ClassVar[dict[str, Any] | None] = None

    def extra_unavailable(self, probe: Any) -> list[str]:
        if _torch_version(probe) < MIN_TORCH:
            return [f"torch {probe.torch.version} has no FlexAttention (needs torch >= {MIN_TORCH})"]
        return []

    def extra_reasons(self, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
        if call.device == "cpu" and call.requires_grad:
            return ["no backward on CPU (torch's FlexAttention: 'does not support backward on CPU')"]
        if call.trace == "compile" and call.dynamic:
            return [GRAPH_DYNAMIC]
        if call.trace == "compile" and call.requires_grad and (call.symbolic or call.varlen):
            return [GRAPH_GRAD_VARLEN if call.varlen else GRAPH_GRAD]
        return []

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        flex, create_block_mask = _flex()
        device = q.device
        mask_mod, score_mod, q_len, kv_len = mask_and_score(call, p, device)
        eager_cuda = call.device == "cuda" and not call.trace
        kw: dict[str, Any] = {"score_mod": score_mod, "scale": p.scale, "enable_gqa": call.gqa}
        # BACKEND excludes the knob; without a mask torch's own empty mask has blocks any BLOCK_M divides
        options = dict(self.kernel_options or {}) or (decode_options(call, q_len) if mask_mod is not None else {})
        if options:
            kw["kernel_options"] = options
        if eager_cuda:  # what dynamo specialises a graph on, sizes aside
            compiled = entry_point((self.name, call.dtype, call.requires_grad, call.gqa, call.varlen, call.causal,
                                    call.window is not None, call.alibi, bool(call.softcap), call.head_dim,
                                    tuple(sorted(options))),
                                   None if call.varlen or q_len < DECODE_MAX_Q else
                                   (tuple(q.shape), tuple(k.shape), tuple(v.shape), call.window, p.scale, p.softcap))

            def fn(q: Any, k: Any, v: Any, block_mask: Any, **kw: Any) -> Any:
                return compiled(q, k, v, block_mask, kw)
        else:  # in a graph: the op itself (the graph's compiler lowers it); CPU eager: flex's reference path
            fn = flex
        varlen = call.varlen
        blocks: list[Any] = []  # the block mask, made by the first run: a failure there falls back like a kernel's

        def block_mask() -> Any:
            if blocks:
                return blocks[0]
            # no mask depends on the batch index (varlen is one packed sequence): one mask broadcast over the batch;
            # compiled on CUDA so that a long sequence's mask is not materialised as Q_LEN x KV_LEN booleans
            made = None if mask_mod is None else create_block_mask(mask_mod, None, None, q_len, kv_len, device=device,
                                                                    _compile=eager_cuda)
            if not call.trace:  # in a graph, the mask belongs to that trace
                blocks.append(made)
            return made

        def run(q: Any, k: Any, v: Any) -> Any:
            if varlen:  # (total, H, D) -> (1, H, total, D): one sequence under a document mask
                q, k, v = q[None], k[None], v[None]
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask(),
                     **kw).transpose(1, 2)
            return out[0] if varlen else out

        if call.device == "cuda" or call.trace:
            return run

        def run_cpu(q: Any, k: Any, v: Any) -> Any:  # flex's unfused path warns that it is not compiled: known
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return run(q, k, v)
        return run_cpu


class FlexFlash(Flex):
    name = "flex_flash"
    library = "flash-attn-4"
    limits = (ArchLimits((9, 0), (10, 3), _FLASH),)
    kernel_options: ClassVar[dict[str, Any] | None] = {"BACKEND": "FLASH"}

    def extra_unavailable(self, probe: Any) -> list[str]:
        if _torch_version(probe) < MIN_TORCH_FLASH:
            return [f"torch {probe.torch.version} has no FlexAttention FLASH backend (needs torch >= "
                    f"{MIN_TORCH_FLASH})"]
        if "error" in loaders.FA4_STATE:  # before the opt-in: the race calls it without one (bench/candidates.py)
            return [loaders.FA4_STATE["error"]]
        return [] if os.environ.get(OPT_IN_FLASH) == "1" else [FLASH_BROKEN]
