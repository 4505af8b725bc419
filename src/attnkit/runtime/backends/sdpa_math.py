"""torch SDPA, math sub-backend: the reference. Every device, every dtype, every feature; slowest. Softcap,
which SDPA has no argument for, runs as the same math written out (layout.eager_sdpa)."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits


class SdpaMath(SdpaBackend):
    name = "sdpa_math"
    sdp_name = "MATH"
    lower_right_exact = "never"  # always attnkit's own mask: finite gradients for rows with no key
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
        softcap=True,
        deterministic_backward=True,
        traces=GRAPH_TRACES,
    )
