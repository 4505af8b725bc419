"""Every candidate's output against the independent float64 reference (runtime/reference.py), on sampled query
rows of the first and last sequence and the first and last head: the reference's own definition, at a cost a GPU
bench pays per shape."""

from __future__ import annotations

from typing import Any

from attnkit.bench.candidates import PLAIN, Case

REF_ROWS = 256  # query rows checked per (sequence, head)
# forward max abs error allowed against the reference (2x the smoke's float64 tolerance)
BENCH_TOL = {"float16": 8e-3, "bfloat16": 5e-2, "float32": 4e-4}


def max_error(c: Case, out: Any, name: str) -> float:
    """Max abs error of a candidate's output against the float64 reference on sampled query rows."""
    import torch

    from attnkit.runtime.reference import reference_rows

    s = c.s
    worst = 0.0
    seqs = [0, len(s.lengths) - 1] if s.lengths is not None else [0, s.batch - 1]
    heads = sorted({0, s.heads - 1})
    for b in dict.fromkeys(seqs):
        if s.lengths is not None:
            lo, n = sum(s.lengths[:b]), s.lengths[b]
            q, k, v = c.q[lo:lo + n], c.k[lo:lo + n], c.v[lo:lo + n]
            got = out[b, :n] if (name == PLAIN) else out[lo:lo + n]
            sq = n
        else:
            q, k, v, got = c.q[b], c.k[b], c.v[b], out[b]
            sq = s.seqlen_q
        rows = torch.unique(torch.linspace(0, sq - 1, min(sq, REF_ROWS)).long()).tolist()
        ref = c.references.get(b)  # one reference per case, whatever the number of candidates checked against it
        if ref is None:
            ref = c.references[b] = reference_rows(q, k, v, rows, heads, causal=s.causal, window=s.window,
                                                   alibi_slopes=c.slopes, softcap=s.softcap)
        worst = max(worst, (got[rows][:, heads].double() - ref).abs().max().item())
    return worst
