"""FlashAttention-4 (`flash-attn-4` on PyPI, module `flash_attn.cute`): FlashAttention in CuTe DSL, a
pure-Python wheel whose kernels are JIT-compiled at first use of each configuration; no wheel build, no
torch-ABI match. Measured on the H200 against the plain SDPA call (docs/results/2026-11-30-h200-bench.json):
1.7-9x on sliding windows, ~6x on packed varlen, 1.2-2.6x on chunked prefill, 1.06-1.16x on long training calls;
slower on decode and small calls, which the selection rows (runtime/priority.py) keep away from it.

Limits per architecture, from flash_attn/cute/interface.py of 4.0.0b36 (the pinned release):
- sm90: (head_dim, head_dim_v) in 8..256, multiples of 16 bytes (`_validate_head_dims`); deterministic
  backward through semaphores. The only row run here (H200).
- sm100/sm110: head dims up to 128, plus the dedicated 256 kernels; (192, 128) is left out (q and v head
  dims differ, which attnkit declares for no FA4 row).
- sm120: SM80-style MMA in 99 KB of shared memory: tiles for head dims up to 128; no deterministic backward
  ("deterministic backward not supported on SM 12.0"); no split-KV.
sm8x has a forward kernel but no backward ("Supported: 9.x, 10.x, 11.x, 12.x"), so no row here. No dropout
argument; ALiBi and arbitrary bias only through score_mod, which attnkit does not use; fp8 is forward-only.
Under torch.compile the same kernels run through attnkit's torch.library ops (fa4_ops.py).

`import flash_attn.cute` takes ~4.6 s (CuTe DSL / MLIR), so nothing imports it until this backend is chosen
for a call or `attnkit doctor` / `attnkit warmup` asks. Just before that import, FA4's compiled-kernel disk
cache is switched on inside attnkit's cache folder, unless the user set FA4's own variables: a configuration
then compiles once per machine (seconds) instead of once per process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from attnkit.runtime import loaders
from attnkit.runtime.backends.base import ArchLimits, Backend, Limits, Runner
from attnkit.runtime.call import AttentionCall, Params

# traces: under torch.compile / torch.export the call goes through attnkit's torch.library ops (fa4_ops.py)
_COMMON = Limits(dtypes=frozenset({"float16", "bfloat16"}), head_dim_multiple=8, gqa="native", varlen="native",
                 window=True, softcap=True, traces=frozenset({"compile"}))

def fa4_window(window: tuple[int, int]) -> tuple[int | None, int | None]:
    """attnkit's -1 (unbounded) is FA4's None; both align the window bottom-right."""
    return (None if window[0] < 0 else window[0], None if window[1] < 0 else window[1])


def output_of(out: Any) -> Any:
    """FA4's functions return (out, lse) in the 4.0 betas and out in others."""
    return out[0] if type(out) is tuple else out


class FlashAttn4(Backend):
    name = "flash_attn4"
    library = "flash-attn-4"
    compiles = True
    limits = (
        ArchLimits((9, 0), (9, 0), replace(_COMMON, max_head_dim=256, deterministic_backward=True)),
        ArchLimits((10, 0), (11, 9), replace(_COMMON, max_head_dim=128, extra_head_dims=frozenset({256}),
                                             deterministic_backward=True)),
        ArchLimits((12, 0), (12, 9), replace(_COMMON, max_head_dim=128)),
    )

    def extra_unavailable(self, probe: Any) -> list[str]:
        return [loaders.FA4_STATE["error"]] if "error" in loaders.FA4_STATE else []

    def import_library(self) -> float | None:
        loaders.load_fa4()
        return loaders.fa4_import_seconds()

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        from attnkit.runtime.backends import fa4_ops, fa4_replay

        left, right = p.window or (-1, -1)  # the ops' arguments after q, k, v (fa4_ops.FWD_SCHEMA)
        args: tuple[Any, ...] = (p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q if call.varlen else -1,
                p.max_seqlen_k if call.varlen else -1, p.scale, call.causal, left, right,
                float(p.softcap) if call.softcap else 0.0)
        if call.trace == "compile":  # recorded as attnkit::fa4_fwd / fa4_bwd: nothing imported while tracing
            if not call.requires_grad:  # no autograd, no log-sum-exp (fa4_ops says what that saves)
                infer = fa4_ops.ops().fa4_fwd_infer
                return lambda q, k, v: infer(q, k, v, *args)
            if fa4_ops.exporting():  # the op with its backward registered: an exported program trains
                op = fa4_ops.ops().fa4_fwd
                return lambda q, k, v: op(q, k, v, *args)[0]
            graph_train, det_graph = fa4_ops.graph_function().apply, call.deterministic
            return lambda q, k, v: graph_train(q, k, v, *args, det_graph)
        fa = loaders.load_fa4()
        if not fa4_replay.enabled():  # ATTNKIT_FA4_REPLAY=0: FA4's own functions, as a user calls them
            return _own_runner(fa, call, p)
        import torch

        train, forward, det = fa4_ops.eager_function().apply, fa4_ops.forward, call.deterministic

        def run_or_replay(q: Any, k: Any, v: Any) -> Any:
            # autograd: FA4's forward and backward, each with its host path replayed (fa4_ops.eager_function); a
            # call without it: the replayed forward alone, no log-sum-exp
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return train(q, k, v, *args, det)
            return forward(q, k, v, *args, lse=False)[0]
        return run_or_replay


def _own_runner(fa: Any, call: AttentionCall, p: Params) -> Runner:
    """FA4's own flash_attn_func / flash_attn_varlen_func: its whole host path on every call."""
    kw: dict[str, Any] = {"softmax_scale": p.scale, "causal": call.causal}
    if p.window is not None:
        kw["window_size"] = fa4_window(p.window)
    if call.softcap:
        kw["softcap"] = p.softcap
    if call.deterministic:
        kw["deterministic"] = True
    if call.varlen:
        fn = fa.flash_attn_varlen_func
        kw.update(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
                  max_seqlen_k=p.max_seqlen_k)
    else:
        fn = fa.flash_attn_func
    return lambda q, k, v: output_of(fn(q, k, v, **kw))
