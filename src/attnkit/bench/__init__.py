"""The bench package. `attnkit bench` (run.py): attnkit against the calls a user would otherwise write, side by
side in one process.

Candidates per shape:
- `sdpa_plain`: F.scaled_dot_product_attention as a user writes it: no context manager, `enable_gqa` for GQA,
  `causal_lower_right` for causal with fewer queries than keys, a mask built once (outside the timing) for a
  sliding window, and for packed varlen the padded batch with its padding mask (what one does without a
  varlen kernel).
- each library's own function called directly: `flash_attn4` (flash_attn.cute), `flash_attn2`, `xformers`,
  `flex` (torch's FlexAttention compiled, a block mask built once), when installed and able to serve the shape;
- `attnkit:<backend>`: attention() forced to each backend that can serve the shape;
- `attnkit`: attention() choosing for itself.
Two timing modes, both on the host's clock: `sync` (one call, then a device sync: latency, host cost counts)
and `b2b` (N calls back to back, then one sync: throughput, host cost hides behind kernels that are long
enough). Candidates are interleaved in a fresh random order every iteration (the H200's clocks drift within
seconds). Every candidate's output is checked against the float64 reference on sampled rows; one that is
wrong is reported and cannot be the oracle (the fastest correct candidate).

Layout: shapes.py (the call-spec type `Shape` and the suite), candidates.py (the calls raced: plain SDPA, each
library's own function, attnkit forced to each backend, attnkit choosing), timer.py (THE timer: interleaved
samples in both modes, median seconds, GPU warm-up), numerics.py (every output against runtime/reference.py),
run.py (one shape, the suite, ratios, dispatch overhead, the report), plot.py (the PNG), tune.py (`attnkit tune`:
the sweep that writes the selection tables), integrations.py (HF training step, kernels in a compiled graph,
CUDA-graph decode).
"""
