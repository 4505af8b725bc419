"""`attnkit doctor`: what this machine is, which backends work, and which one serves standard shapes (with
the selection row that decided it). Doctor also imports the libraries the probe defers because their import
is slow (FlashAttention-4), so it tells whether they really load."""

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
        "train GQA 32/8 heads": replace(base, heads=32, kv_heads=8),
        "inference causal D128": replace(base, requires_grad=False),
        "decode Sq=1 Sk=4096": replace(base, seqlen_q=1, causal=False, requires_grad=False, batch=64),
        "chunked prefill Sq=512 Sk=4096": replace(base, seqlen_q=512, requires_grad=False),
        "small B=4 S=256 D=64": replace(base, batch=4, seqlen_q=256, seqlen_k=256, head_dim=64, head_dim_v=64),
        "head_dim 256": replace(base, head_dim=256, head_dim_v=256),
        "varlen packed": replace(base, varlen=True, lengths_q=(4096, 1000), lengths_k=(4096, 1000)),
        "sliding window 1024": replace(base, window=(1024, 0)),
        "fp32": replace(base, dtype="float32", head_dim=64, head_dim_v=64),
    }


def import_deferred(p: Probe) -> dict[str, dict[str, Any]]:
    """Import every installed library whose import the probe deferred: name -> {loads, error, import_s}."""
    import time

    out: dict[str, dict[str, Any]] = {}
    for lib in p.libraries:
        if lib.checked or not lib.installed or p.torch is None:
            continue
        backend = next(b for b in REGISTRY.values() if b.library == lib.name)
        t0 = time.perf_counter()
        try:
            took = backend.import_library()  # the process's one import, also when it happened before
            out[lib.name] = {"loads": True, "error": None,
                             "import_s": round(took if took is not None else time.perf_counter() - t0, 2)}
        except Exception as exc:
            out[lib.name] = {"loads": False, "error": str(exc), "import_s": round(time.perf_counter() - t0, 2)}
    return out


def report(p: Probe | None = None, deep: bool = True) -> dict[str, Any]:
    from attnkit.runtime.priority import order_for
    from attnkit.runtime.select import SELECTOR, NoBackendError

    p = p or probe()
    imported = import_deferred(p) if deep else {}
    device = "cuda" if p.has_gpu and p.torch is not None and p.torch.cuda_available else "cpu"
    backends = {}
    for name, b in REGISTRY.items():  # "available" = can run on this machine's device, with the reason when not
        why = b.unavailable(p) or _device_reason(b, device)
        backends[name] = {"available": not why, "reasons": why}
    shapes: dict[str, Any] = {}
    for label, call in (standard_calls(device).items() if p.torch is not None else ()):
        decided = order_for(call, p.capability(call.device_index) if device == "cuda" else None)[1]
        try:
            chosen = SELECTOR.select(call, p).name
            shapes[label] = {"call": call.describe(), "backend": chosen, "decided_by": decided.describe()}
        except NoBackendError as exc:
            shapes[label] = {"call": call.describe(), "backend": None, "error": str(exc).splitlines()[0]}
    fast = [n for n, b in backends.items() if b["available"] and n != "sdpa_math"]
    healthy = p.torch_error is None and ((not p.has_gpu) or bool(
        fast and any(s["backend"] not in (None, "sdpa_math") for s in shapes.values())))
    doc: dict[str, Any] = {"probe": p.to_dict(), "device": device, "backends": backends, "shapes": shapes, "healthy": healthy}
    for lib in doc["probe"]["libraries"]:
        if lib["name"] in imported:
            lib.update(imported[lib["name"]], checked=True)
    return doc


def _device_reason(b: Any, device: str) -> list[str]:
    limits = b.first_limits()
    if device in limits.devices:
        return []
    return [f"runs on {'/'.join(sorted(limits.devices))}; this machine runs attention on {device}"]


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
              f"torch {t['version'] if t else ('BROKEN' if pr['torch_error'] else 'not installed')}"
              + (f" (CUDA {t['cuda']}, cuDNN {t['cudnn']}, cxx11abi {t['cxx11_abi']})" if t else ""))
    gpus = pr["gpus"]
    if gpus:
        for g in gpus:
            con.print(f"GPU {g['index']}: {g['name']} sm{g['capability'][0]}{g['capability'][1]}, "
                      f"{g['memory_mib']} MiB, driver {pr['driver']} (via {pr['source']})")
    else:
        con.print("GPU: none visible")
    for note in pr["notes"]:
        con.print(f"[red]{note}[/red]" if pr["torch_error"] and note.startswith(pr["torch_error"]) else f"note: {note}")
    libs = Table(title="attention libraries")
    for col in ("library", "version", "installed", "loads", "detail", "error"):
        libs.add_column(col)
    for lib in pr["libraries"]:
        detail = lib.get("detail") or ""
        if lib.get("import_s") is not None:
            detail = f"{detail}; import {lib['import_s']} s".lstrip("; ")
        libs.add_row(lib["name"], str(lib["version"] or "-"), str(lib["installed"]), str(lib["loads"]), detail,
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
    st.add_column("selection row")
    for label, s in rep["shapes"].items():
        st.add_row(label, s["call"], s["backend"] or f"[red]none[/red] {s.get('error', '')}", s.get("row", ""))
    if rep["shapes"]:
        con.print(st)
    else:
        con.print("selection: no attention backend can run without a working torch")
    if pr["torch_error"]:
        return 1
    if not rep["healthy"]:
        con.print("[red]this machine has a GPU but no fast attention backend works[/red]")
        return 1
    return 0
