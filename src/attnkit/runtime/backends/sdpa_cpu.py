"""torch SDPA's flash kernel for CPU (the same SDPBackend.FLASH_ATTENTION, CPU implementation): what torch
itself picks on CPU, several times faster than the math reference there."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits
from attnkit.runtime.call import AttentionCall


class SdpaCpu(SdpaBackend):
    name = "sdpa_cpu"
    sdp_name = "FLASH_ATTENTION"
    lower_right_exact = "never"
    limits = Limits(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        max_head_dim=1 << 16,
        gqa="native",
        dropout=False,
        traces=GRAPH_TRACES,
    )

    def extra_reasons(self, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
        # its causal flag is top-left only, and it takes no mask: no bottom-right alignment
        if call.causal and call.seqlen_q != call.seqlen_k:
            return ["causal only when seqlen_q == seqlen_k (no bottom-right alignment)"]
        return []
