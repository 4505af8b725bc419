"""The bench report's chart: speed relative to the plain SDPA call per shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.bench.candidates import AUTO, LIBRARIES, PLAIN


def chart(report: dict[str, Any], path: Path) -> None:
    """Speed relative to the plain SDPA call per shape (b2b; fwd+bwd where timed): attnkit, the oracle, and
    each library's direct call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["shapes"]
    names = [AUTO, *LIBRARIES]
    fig, ax = plt.subplots(figsize=(max(12, 0.55 * len(rows)), 6))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = []
        for r in rows:
            ps = "fwdbwd" if "fwdbwd" in r["ratios"] else "fwd"
            t = r["ms"].get(n, {}).get(ps, {}).get("b2b")
            plain = r["ms"].get(PLAIN, {}).get(ps, {}).get("b2b")
            vals.append(plain / t if t and plain else 0.0)
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=n,
               edgecolor="black" if n == AUTO else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["label"] + ("" if r["shape"]["train"] else " (fwd)") for r in rows], rotation=40,
                       ha="right", fontsize=7)
    ax.set_ylabel("speed vs plain F.scaled_dot_product_attention (b2b)")
    gpu = report["environment"]["probe"]["gpus"]
    ax.set_title(f"attnkit bench: {gpu[0]['name'] if gpu else 'CPU'}, torch "
                 f"{report['environment']['probe']['torch']['version']}, {report['environment']['date'][:10]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
