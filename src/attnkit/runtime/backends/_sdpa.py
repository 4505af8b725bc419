"""Shared bind() for torch SDPA: the `sdpa` backend (torch's own kernel choice) and the forced sub-backends
(`sdpa_cudnn`, `sdpa_flash`, `sdpa_efficient`, `sdpa_math`, `sdpa_cpu`); each module only declares limits.

Converts attnkit's (B, S, H, D) / varlen semantics to SDPA's (B, H, S, D) with top-left `is_causal`:
bottom-right causal with seqlen_q != seqlen_k goes through torch's `causal_lower_right` bias where the
kernel supports it, otherwise through an explicit mask from `layout.allowed_mask`, built once per shape.

The route to the kernel is decided once per call signature, never per call: `sdpa`, and a forced sub-backend
whose kernel is torch's own choice for this call (`torch._fused_sdp_choice`, asked at bind time), calls
F.scaled_dot_product_attention plainly (the very call a user writes), which chooses again on every call: a
user's `sdpa_kernel` context or `enable_*_sdp(False)` applies, as it does to the plain call. The exception is a
call that needs a backward where torch picks flash: its op is called directly, so that no cuDNN gradient-layout
hook is needed. When torch's choice is not the forced kernel, a call with no mask
whose forced kernel passes torch's own eligibility check (`torch.backends.cuda.can_use_cudnn_attention` /
`can_use_flash_attention`) calls that kernel's op directly; only the rest pay for the `sdpa_kernel` context,
which costs ~20 us per call (timeit on the 2-core dev machine, torch 2.13 CPU: 35 vs 15 us).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

from attnkit.runtime import layout
from attnkit.runtime.backends.base import Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params


@functools.cache
def _sdp_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


def grad_like_output(out: Any) -> Any:
    """Hand cuDNN's attention backward an output gradient laid out like the output it returned.

    Why: on torch 2.11 / cuDNN 9.19 (H200), `_scaled_dot_product_cudnn_attention_backward` returns wrong
    dq/dk/dv (errors of 4-40 on unit-variance inputs; the forward is right) when grad_out's strides differ
    from out's, at least once a graph for those sizes was built with the other layout: the stride of dO is not
    part of what torch's cuDNN path specialises on. attnkit's padded-varlen route produces exactly that
    (`masked_fill` of keyless rows turns a (B, H, S, D) view of a (B, S, H, D) buffer into a contiguous
    gradient), which is how flash-attn's test grid found 219-242 wrong varlen + ALiBi gradients
    (docs/cudnn-grad-layout.md has the plain-torch reproduction). The hook costs nothing in the forward and
    one copy of dO in the backward only when the layouts differ."""
    stride = out.stride()

    def relayout(grad: Any) -> Any:
        if grad.stride() == stride:
            return grad
        return grad.new_empty_strided(grad.shape, stride).copy_(grad)

    out.register_hook(relayout)
    return out


def cudnn_backward_possible(call: AttentionCall, sdp_name: str | None) -> bool:
    """Can this call's backward run cuDNN's kernel (forced, or as torch's own pick, eager or in a torch.compile
    graph)? softcap runs eager math; a torch.jit.trace graph keeps its kernels as traced."""
    return (call.requires_grad and call.device == "cuda" and not call.softcap and call.trace in ("", "compile")
            and sdp_name in (None, "CUDNN_ATTENTION"))


@functools.lru_cache(maxsize=layout.MASK_CACHE_SIZE)
def _empty_rows_lower_right(sq: int, sk: int, device: Any) -> Any:
    """(1, 1, sq, 1): the first sq - sk queries of bottom-right causal with sq > sk see no key."""
    import torch

    return (torch.arange(sq, device=device) < sq - sk).view(1, 1, sq, 1)


class SdpaBackend(Backend):
    limits: Limits = Limits()  # one set of limits: torch's kernels do not differ per architecture here
    sdp_name: str | None = None  # torch.nn.attention.SDPBackend member to force; None = torch's own choice
    # Where torch's CausalBias (lower_right) is exact for this kernel, so no dense mask is needed: "always",
    # "if_sq_le_sk" (measured wrong for sdpa_efficient when seqlen_q > seqlen_k on the H200, torch 2.11: rows
    # that see no key), or "never"
    lower_right_exact: Literal["always", "if_sq_le_sk", "never"] = "always"

    def extra_unavailable(self, probe: Any) -> list[str]:
        try:
            from torch.nn.attention import SDPBackend
        except ImportError:
            return ["this torch has no torch.nn.attention.SDPBackend (needs torch >= 2.3)"]
        if self.sdp_name is not None and not hasattr(SDPBackend, self.sdp_name):
            return [f"this torch has no SDPBackend.{self.sdp_name}"]
        return []

    def _lower_right_ok(self, sq: int, sk: int) -> bool:
        return self.lower_right_exact == "always" or (self.lower_right_exact == "if_sq_le_sk" and sq <= sk)

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        import torch.nn.functional as F

        sdpa = F.scaled_dot_product_attention
        if call.softcap:  # SDPA has no softcap argument: the same math, written out (limits allow sdpa_math only)
            sdpa = functools.partial(layout.eager_sdpa, softcap=p.softcap)
        device = q.device
        kw: dict[str, Any] = {}
        if p.dropout_p:
            kw["dropout_p"] = p.dropout_p
        if abs(p.scale * math.sqrt(call.head_dim) - 1.0) > 1e-12:  # SDPA's default is 1/sqrt(head_dim)
            kw["scale"] = p.scale
        # the legacy ONNX exporter has no GQA form of SDPA: k/v heads are expanded in the graph
        expand = call.gqa and (self.limits.gqa == "expand" or call.trace == "jit")
        if call.gqa and not expand:
            kw["enable_gqa"] = True
        sq, sk = call.seqlen_q, call.seqlen_k
        needs_mask = call.varlen or call.window is not None or call.alibi or call.bias or call.softcap
        empty = None
        bias_object = False
        bias_of: Any = None
        if not needs_mask and (not call.causal or sq == sk):
            if call.causal:
                kw["is_causal"] = True
        elif not needs_mask and self._lower_right_ok(sq, sk) and not call.trace:
            from torch.nn.attention.bias import causal_lower_right

            kw["attn_mask"] = causal_lower_right(sq, sk)
            bias_object = True
            if sq > sk:
                empty = _empty_rows_lower_right(sq, sk, device)
        elif call.trace == "compile":  # sizes may be symbolic and values unknown: a mask built in the graph
            ok, empty = layout.graph_mask(q.shape[-3], k.shape[-3], call.causal, call.window, device)
            kw["attn_mask"] = (layout.dense_bias(ok, q.dtype, alibi_slopes=p.alibi_slopes, attn_bias=p.attn_bias)
                               if call.alibi or call.bias else ok)
        else:
            lengths = (call.lengths_q, call.lengths_k) if call.varlen else None
            ok, empty = layout.cached_mask(sq, sk, call.causal, call.window, device, lengths)
            if call.alibi or call.bias:  # one build per slopes / bias tensor and version (layout.BiasCache),
                # fetched per call so that a bound call never holds a bias of its own (they are large)
                bias_of = functools.partial(layout.BIASES.get, ok, q.dtype, alibi_slopes=p.alibi_slopes,
                                            attn_bias=p.attn_bias,
                                            cu_seqlens_q=p.cu_seqlens_q if call.varlen else None,
                                            cu_seqlens_k=p.cu_seqlens_k if call.varlen else None)
                learned = any(t is not None and t.requires_grad for t in (p.alibi_slopes, p.attn_bias))
                if not learned:  # for torch's pick below; a learned bias is built per call, in run(), only
                    kw["attn_mask"] = bias_of()
            else:
                kw["attn_mask"] = ok

        # cuDNN's backward may run (forced, or torch's own pick, which a graph or a mask object hides from us):
        # its output gradient must arrive laid out like its output (grad_like_output; in a graph, _sdpa_graph.LikeOutput)
        guard = cudnn_backward_possible(call, self.sdp_name)
        like: Any = None
        if guard and call.trace == "compile":  # a graph records no tensor hook: the same relayout as an op
            # (not under torch.jit.trace: TorchScript would keep a Python op it cannot save)
            from attnkit.runtime.backends._sdpa_graph import LikeOutput

            like = LikeOutput
        idx_q = idx_k = None
        if call.varlen:  # indices into the padded buffer: computed once per cu_seqlens, not per call
            idx_q = layout.varlen_indices(p.cu_seqlens_q, sq)
            idx_k = layout.varlen_indices(p.cu_seqlens_k, sk)
        batch, heads = call.batch, call.heads

        def run(q: Any, k: Any, v: Any) -> Any:
            if idx_q is not None:
                q = layout.unpack(q, idx_q, batch, sq)
                k = layout.unpack(k, idx_k, batch, sk)
                v = layout.unpack(v, idx_k, batch, sk)
            if expand:
                k, v = layout.expand_kv(k, heads), layout.expand_kv(v, heads)
            if bias_of is None:
                out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
            else:
                out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias_of(), **kw)
            if like is not None:
                out = like.apply(out)
            elif guard and out.requires_grad:
                out = grad_like_output(out)
            if empty is not None:  # all-False unless some row sees no key: no host sync to find out
                out = out.masked_fill(empty, 0.0)
            out = out.transpose(1, 2)
            if idx_q is not None:
                out = out.reshape(batch * sq, *out.shape[2:]).index_select(0, idx_q)
            return out

        if not (idx_q is not None or expand or empty is not None or guard or bias_of is not None):
            def run_plain(q: Any, k: Any, v: Any) -> Any:  # the plain call, nothing around it
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)
            run = run_plain

        wanted = None if self.sdp_name is None else int(_sdp_backend(self.sdp_name))
        if bias_of is not None:  # the bias is fetched per call (run): the runner holds none of its own
            picked = None
            if "attn_mask" in kw:
                if wanted is not None and not (call.trace or call.softcap):
                    picked = self._torch_pick(q, k, v, call, kw)
                del kw["attn_mask"]
            if call.softcap or wanted in (None, picked):
                return run
            return self._forced(run)
        if call.softcap:
            return run
        # in a graph the host-time shortcuts buy nothing, and torch's pick is made when the graph is traced
        as_given = not (idx_q is not None or expand or empty is not None or "attn_mask" in kw)
        picked = None
        if (wanted is not None or guard) and not (bias_object or call.trace):
            picked = self._torch_pick(q, k, v, call, kw)
        if wanted is None and guard and as_given and picked == int(_sdp_backend("FLASH_ATTENTION")):
            # torch picks flash for a call that needs a backward: its op called directly needs no cuDNN
            # gradient-layout hook (that hook costs 2-5 us a step), and cannot become cuDNN in a later call
            # (a forced sdpa_flash has no guard: it never runs cuDNN)
            direct = _direct(picked, kw, call, False)
            if direct is not None:
                return direct
        if wanted is None or picked == wanted:  # torch's own pick: the plain call (the kernel's op called from
            return run  # Python cost more host time, not less: tools/probe-direct-route.py, H100, ~1 us a call)
        if picked is not None and as_given and self._torch_accepts(q, k, v, kw):
            direct = _direct(wanted, kw, call, guard)  # the forced kernel's op, without the context's ~10-20 us
            if direct is not None:
                return direct
        return self._forced(run)

    def _forced(self, run: Runner) -> Runner:
        """`run` inside `sdpa_kernel([this backend])`: only where torch's own choice would be another kernel."""
        from torch.nn.attention import sdpa_kernel

        chosen = [_sdp_backend(self.sdp_name)]

        def forced(q: Any, k: Any, v: Any) -> Any:
            with sdpa_kernel(chosen):
                return run(q, k, v)
        return forced

    def _torch_accepts(self, q: Any, k: Any, v: Any, kw: dict[str, Any]) -> bool:
        """Does torch's own eligibility check for the forced kernel (`torch.backends.cuda.can_use_*`, the check
        `sdpa_kernel([it])` would make) pass for this call? Only then may its op be called directly: outside
        that check a kernel may not refuse an input it cannot handle. False where this torch has no such check.
        Asked once, at bind, like torch's own pick above: a later call of the same shapes in
        another layout (the dispatch key holds no strides) reaches the op unchecked, where the context re-checked
        every call. Such a call is rare (one call site keeps its layout), and an op that rejects it raises, which
        attention() turns into a fallback; a per-call stride check would cost ~0.2 us on every call."""
        import torch

        cuda = torch.backends.cuda
        check = getattr(cuda, _CAN_USE.get(self.sdp_name or "", ""), None)
        params = getattr(cuda, "SDPAParams", None)
        if check is None or params is None:
            return False
        try:
            return bool(check(params(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                     kw.get("dropout_p", 0.0), kw.get("is_causal", False),
                                     kw.get("enable_gqa", False)), False))
        except Exception:  # an older torch's SDPAParams signature: no shortcut
            return False

    def _torch_pick(self, q: Any, k: Any, v: Any, call: AttentionCall, kw: dict[str, Any]) -> int | None:
        """The kernel a plain F.scaled_dot_product_attention call would run for this call (None: unknown)."""
        import torch

        choice = getattr(torch, "_fused_sdp_choice", None)
        if choice is None or call.varlen or (self.limits.gqa == "expand" and call.gqa):
            return None
        try:
            return int(choice(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              attn_mask=kw.get("attn_mask"), dropout_p=kw.get("dropout_p", 0.0),
                              is_causal=kw.get("is_causal", False), scale=kw.get("scale"),
                              enable_gqa=kw.get("enable_gqa", False)))
        except Exception:  # an older torch's signature, or an input it rejects: no shortcut
            return None


# torch's eligibility check per kernel that _direct can call (torch.backends.cuda, torch >= 2.5)
_CAN_USE = {"CUDNN_ATTENTION": "can_use_cudnn_attention", "FLASH_ATTENTION": "can_use_flash_attention"}


def _direct(kernel: int, kw: dict[str, Any], call: AttentionCall, guard: bool) -> Runner | None:
    """The kernel's own op, called the way F.scaled_dot_product_attention calls it once it has chosen (its
    cuDNN and flash branches: k/v as given, GQA handled by the kernel, log-sum-exp only for a backward): for a
    forced kernel that torch would not pick, instead of the sdpa_kernel context. Not for torch's own pick: there
    the plain call costs less host time than the op called from Python, which hands its whole tuple of outputs
    back (tools/probe-direct-route.py, H100, 2026-12-06: ~1 us a forward call). Only for calls with no mask, where
    both kernels take the arguments as they are; anything the op rejects raises, and attention() falls back."""
    import torch

    if call.device != "cuda":
        return None
    dropout, causal, scale = kw.get("dropout_p", 0.0), kw.get("is_causal", False), kw.get("scale")
    if kernel == int(_sdp_backend("CUDNN_ATTENTION")):
        cudnn = getattr(torch, "_scaled_dot_product_cudnn_attention", None)
        if cudnn is None:
            return None
        lse = call.requires_grad

        def run_cudnn(q: Any, k: Any, v: Any) -> Any:
            return cudnn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, lse, dropout, causal, False,
                         scale=scale)[0].transpose(1, 2)

        def run_cudnn_guarded(q: Any, k: Any, v: Any) -> Any:
            out = cudnn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, lse, dropout, causal, False,
                        scale=scale)[0]
            return (grad_like_output(out) if out.requires_grad else out).transpose(1, 2)
        return run_cudnn_guarded if guard and lse else run_cudnn
    if kernel == int(_sdp_backend("FLASH_ATTENTION")) and call.head_dim % 8 == 0 and call.head_dim_v % 8 == 0:
        flash = getattr(torch, "_scaled_dot_product_flash_attention", None)
        if flash is None:
            return None

        def run_flash(q: Any, k: Any, v: Any) -> Any:
            return flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout, causal, False,
                         scale=scale)[0].transpose(1, 2)
        return run_flash
    return None
