"""torch SDPA, cuDNN sub-backend: the fastest kernel on Hopper for bf16/fp16 (~1.8x FlashAttention-2 on an
H200: docs/results/2026-11-30-h200-bench-flash-attn.json). Measured there with torch 2.11 / cuDNN 9.19 (docs/results): native GQA
(enable_gqa), head_dim up to 256 (512 has no kernel), lower-right causal bias, boolean and float masks,
dropout."""

from attnkit.runtime.backends._sdpa import SdpaBackend
from attnkit.runtime.backends.base import GRAPH_TRACES, Limits


class SdpaCudnn(SdpaBackend):
    name = "sdpa_cudnn"
    sdp_name = "CUDNN_ATTENTION"
    lower_right_exact = "if_sq_le_sk"
    limits = Limits(
        min_capability=(9, 0),  # torch enables cuDNN attention by default only from Hopper on
        dtypes=frozenset({"float16", "bfloat16"}),
        max_head_dim=256,
        head_dim_multiple=8,
        gqa="native",
        window=True,
        alibi=True,
        alibi_bias=True,
        bias=True,
        dropout=True,
        traces=GRAPH_TRACES,
    )
