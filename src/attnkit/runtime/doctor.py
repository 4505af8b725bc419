"""`attnkit doctor`: what this machine is, which backends work, and which one serves standard shapes."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from attnkit.runtime.backends import REGISTRY
from attnkit.runtime.call import AttentionCall
from attnkit.runtime.probe import Probe, probe


def standard_calls(device: str) -> dict[str, AttentionCall]:
    """A few shapes people run, for 'which backend would serve this?'."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    base = AttentionCall(device=device, device_index=0, dtype=dtype, batch=8, seqlen_q=4096, seqlen_k=4096,
                         heads=16, kv_heads=16, head_dim=128, head_dim_v=128, causal=True, dropout=False,
                         window=None, alibi=False, bias=False, varlen=False, requires_grad=True)
    return {
        "train causal D128": base,
        "GQA 32/8 heads": replace(base, heads=32, kv_heads=8),
        "decode Sq=1 Sk=4096": replace(base, seqlen_q=1, causal=False, requires_grad=False, batch=64),
        "head_dim 256": replace(base, head_dim=256, head_dim_v=256),
        "varlen packed": replace(base, varlen=True),
        "sliding window 1024": replace(base, window=(1024, 0)),
        "fp32": replace(base, dtype="float32", head_dim=64, head_dim_v=64),
    }


def report(p: Probe | None = None) -> dict[str, Any]:
    from attnkit.runtime.select import SELECTOR, NoBackendError

    p = p or probe()
    device = "cuda" if p.has_gpu and p.torch is not None and p.torch.cuda_available else "cpu"
    backends = {name: {"available": not b.unavailable(p), "reasons": b.unavailable(p)} for name, b in REGISTRY.items()}
    shapes: dict[str, Any] = {}
    for label, call in standard_calls(device).items():
        try:
            chosen = SELECTOR.select(call, p).name
            shapes[label] = {"call": call.describe(), "backend": chosen}
        except NoBackendError as exc:
            shapes[label] = {"call": call.describe(), "backend": None, "error": str(exc).splitlines()[0]}
    fast = [n for n, b in backends.items() if b["available"] and n != "sdpa_math"]
    healthy = (not p.has_gpu) or bool(fast and any(s["backend"] not in (None, "sdpa_math") for s in shapes.values()))
    return {"probe": p.to_dict(), "device": device, "backends": backends, "shapes": shapes, "healthy": healthy}


def run_doctor(as_json: bool = False) -> int:
    rep = report()
    if as_json:
        print(json.dumps(rep, indent=2, default=str))
        return 0 if rep["healthy"] else 1
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    pr = rep["probe"]
    t = pr["torch"]
    con.print(f"[bold]attnkit doctor[/bold]  Python {pr['python']} ({pr['platform']}), "
              f"torch {t['version'] if t else 'not installed'}"
              + (f" (CUDA {t['cuda']}, cuDNN {t['cudnn']}, cxx11abi {t['cxx11_abi']})" if t else ""))
    gpus = pr["gpus"]
    if gpus:
        for g in gpus:
            con.print(f"GPU {g['index']}: {g['name']} sm{g['capability'][0]}{g['capability'][1]}, "
                      f"{g['memory_mib']} MiB, driver {pr['driver']} (via {pr['source']})")
    else:
        con.print("GPU: none visible")
    for note in pr["notes"]:
        con.print(f"note: {note}")
    libs = Table(title="attention libraries")
    for col in ("library", "version", "installed", "loads", "error"):
        libs.add_column(col)
    for lib in pr["libraries"]:
        libs.add_row(lib["name"], str(lib["version"] or "-"), str(lib["installed"]), str(lib["loads"]),
                     lib["error"] or "")
    con.print(libs)
    bt = Table(title="backends")
    bt.add_column("backend")
    bt.add_column("available")
    bt.add_column("why not")
    for name, b in rep["backends"].items():
        bt.add_row(name, "yes" if b["available"] else "no", "; ".join(b["reasons"]))
    con.print(bt)
    st = Table(title=f"selection on {rep['device']}")
    st.add_column("shape")
    st.add_column("call")
    st.add_column("backend")
    for label, s in rep["shapes"].items():
        st.add_row(label, s["call"], s["backend"] or f"[red]none[/red] {s.get('error', '')}")
    con.print(st)
    if not rep["healthy"]:
        con.print("[red]this machine has a GPU but no fast attention backend works[/red]")
        return 1
    return 0
