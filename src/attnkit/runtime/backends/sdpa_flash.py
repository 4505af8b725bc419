"""torch SDPA, FlashAttention-2 sub-backend (built into torch): no extra install, native GQA."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits


class SdpaFlash(SdpaBackend):
    name = "sdpa_flash"
    sdp_name = "FLASH_ATTENTION"
    limits = Limits(
        min_capability=(8, 0),
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        gqa="native",
        dropout=True,
        traces=GRAPH_TRACES,
    )
