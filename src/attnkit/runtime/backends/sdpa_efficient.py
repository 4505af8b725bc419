"""torch SDPA, memory-efficient (xformers-derived cutlass) sub-backend: runs from sm50 (V100 included),
fp32 too, and takes masks, so it serves windows, ALiBi, bias and (padded) varlen."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits


class SdpaEfficient(SdpaBackend):
    name = "sdpa_efficient"
    sdp_name = "EFFICIENT_ATTENTION"
    lower_right_exact = "if_sq_le_sk"
    limits = Limits(
        min_capability=(5, 0),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        max_head_dim=512,
        head_dim_multiple=8,
        head_dim_v_differs=True,
        gqa="expand",
        varlen="padded",
        window=True,
        alibi=True,
        alibi_bias=True,
        bias=True,
        dropout=True,
        traces=GRAPH_TRACES,
    )
