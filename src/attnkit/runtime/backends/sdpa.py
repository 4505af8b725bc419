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
        bias=True,
        dropout=True,
        traces=GRAPH_TRACES,
    )
