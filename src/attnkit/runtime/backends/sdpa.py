"""torch SDPA with torch's own kernel choice: exactly the call a user writes, F.scaled_dot_product_attention
with no kernel forced and no context manager around it, plus attnkit's semantics (bottom-right causal through
`causal_lower_right`, windows and varlen through masks built once per shape).

Why a backend of its own: where torch already runs the best kernel for a call, anything attnkit forces only
adds host time. On the H200 that is decode (one query), small batches of short sequences, and causal with
fewer queries than keys when FlashAttention-4 is absent (torch runs its native bottom-right flash kernel
there, faster than cuDNN with a materialised lower-right mask; docs/results/2026-11-30-h200-bench-1.json). Every input is
served: torch falls back to its math kernel where no fused kernel fits."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits
from attnkit.runtime.call import AttentionCall

# flash-attn's grid on this CPU (its dry-run part: 384 float16 cases, torch 2.13, 2026-12-01): torch's CPU pick
# missed the gradient tolerance on 2 cases, both MQA with ALiBi (a bias), dk one float16 ulp (0.0078) over 3x
# PyTorch's own low-precision error (0.0059); sdpa_math passed all 384. bfloat16 takes the same CPU kernel.
CPU_HALF_GQA_BIAS = ("on CPU, torch's own kernel misses flash-attn's gradient tolerance for GQA/MQA with a bias in "
                     "half precision (dk, flash-attn's grid on the CPU, 2 of 384 cases)")


class Sdpa(SdpaBackend):
    name = "sdpa"
    sdp_name = None
    lower_right_exact = "if_sq_le_sk"  # rows that see no key (seqlen_q > seqlen_k) need attnkit's own mask, then zeros
    limits = Limits(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        max_head_dim=1 << 16,
        head_dim_v_differs=True,
        gqa="native",
        varlen="padded",
        window=True,
        alibi=True,
        alibi_bias=True,
        bias=True,
        dropout=True,
        traces=GRAPH_TRACES,
    )

    def extra_reasons(self, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
        if (call.device == "cpu" and call.requires_grad and call.gqa and (call.alibi or call.bias)
                and call.dtype in ("float16", "bfloat16")):
            return [CPU_HALF_GQA_BIAS]
        return []
