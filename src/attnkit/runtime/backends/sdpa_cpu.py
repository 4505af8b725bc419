"""torch SDPA's flash kernel for CPU (the same SDPBackend.FLASH_ATTENTION, CPU implementation): what torch
itself picks on CPU, several times faster than the math reference there."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits


class SdpaCpu(SdpaBackend):
    name = "sdpa_cpu"
    sdp_name = "FLASH_ATTENTION"
    causal_bias = "none"
    limits = Limits(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        max_head_dim=1 << 16,
        gqa="native",
        causal_unequal=False,
        dropout=False,
        traces=GRAPH_TRACES,
    )
