"""`attnkit smoke` (run by `nox -s smoke`): every backend this machine has, forward AND backward, against the
float64 reference, for every feature a backend claims: MHA, GQA, bottom-right causal with fewer and with more
queries than keys, decode, varlen (with keyless rows), sliding windows, ALiBi (also far from the diagonal, where
a bias cast to bf16 used to lose 0.3 of accuracy), softcap. Then the same cases through attention() itself,
whose selection picks the backend, and a set of them through attention() under torch.compile(fullgraph=True). A backend or case this machine cannot run is skipped with the backend's own
reasons. The JSON report holds every check with the doctor report: one file per machine.

It ships inside the package, so an image checks itself with no test files in it.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from attnkit.errors import first_line
from attnkit.runtime.shape import Shape, make_inputs, varlen

# (forward, backward) max abs error per dtype on unit-variance inputs, against the float64 reference
TOL = {"float16": (4e-3, 2e-2), "bfloat16": (2.5e-2, 1e-1), "float32": (2e-4, 2e-3), "float64": (1e-7, 1e-6)}
AUTO = "attnkit"  # the row that goes through attention() and its selection
# attention() under torch.compile(fullgraph=True, dynamic=True): what a graph records (FlashAttention-4 through attnkit's
# torch.library ops, flex, SDPA's aten ops) checked like eager, forward and backward. backend="aot_eager": the
# graph AOTAutograd records, run without inductor's code generation (the kernels are the recorded ops' own)
COMPILED = "attnkit-compiled"
COMPILED_CASES = ("mha", "gqa", "causal_sq_lt_sk", "decode", "varlen", "window", "alibi", "softcap")


def _case(name: str, sq: int = 64, sk: int = 64, h: int = 4, hkv: int = 4, d: int = 64, batch: int = 2,
          causal: bool = False, lengths: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
          **kw: Any) -> Shape:
    """A smoke case as a Shape (its dtype is each check's): small sizes, varlen as (queries, keys) per sequence."""
    if lengths is not None:
        return varlen(name, lengths[0], lengths[1], heads=h, kv_heads=hkv, head_dim=d, causal=causal, **kw)
    return Shape(name, batch, h, hkv, sq, sk, d, causal=causal, **kw)


_CASES: list[Shape] = [
    _case("mha"),
    _case("gqa", h=8, hkv=2),
    _case("causal_sq_lt_sk", sq=40, sk=96, causal=True),
    _case("causal_sq_gt_sk", sq=96, sk=40, hkv=2, causal=True),
    _case("decode", sq=1, sk=200, h=8, hkv=2, causal=True),
    _case("varlen", h=4, hkv=2, causal=True, lengths=((33, 1, 70, 17), (33, 9, 70, 40))),
    _case("varlen_self", h=4, hkv=2, causal=True, lengths=((33, 1, 70, 0, 17), (33, 1, 70, 0, 17))),
    _case("varlen_self_noncausal", lengths=((33, 1, 70, 0, 17), (33, 1, 70, 0, 17))),
    # rows that see no key: a sequence without keys, more queries than keys
    _case("varlen_keyless", h=4, hkv=2, causal=True, lengths=((20, 5, 30, 7), (8, 0, 30, 12))),
    _case("window", sq=80, sk=80, causal=True, window=(16, 0)),
    _case("window_both", sq=80, sk=100, h=4, hkv=2, window=(8, 24)),
    _case("alibi", causal=True, alibi=True),
    # flash-attn's own test rule failed here before the bias was re-centred per row (issue 11): not causal,
    # more queries than keys, so ALiBi reaches -slope * 511
    _case("alibi_cross", sq=512, sk=256, h=4, batch=1, alibi=True),
    _case("softcap", causal=True, softcap=2.0, h=4, hkv=2),
    # packed varlen + ALiBi training (OLMo/MPT), sizes like those where flash-attn's test grid found wrong
    # gradients through cuDNN (issue 21): both cases pad to the same (4, 250, 256), the second with keyless rows
    # (a sequence with more queries than keys), whose zeroing changed the layout of cuDNN's output gradient
    _case("varlen_alibi", h=4, hkv=2, causal=True, alibi=True,
          lengths=((250, 200, 180, 120), (256, 210, 190, 130))),
    _case("varlen_alibi_keyless", h=4, hkv=2, causal=True, alibi=True,
          lengths=((250, 240, 180, 120), (256, 100, 190, 130))),
    _case("varlen_alibi_noncausal", h=4, hkv=1, alibi=True, lengths=((250, 17, 199, 64), (256, 33, 120, 250))),
]
CASES: dict[str, Shape] = {c.label: c for c in _CASES}


def dtypes(device: str) -> list[str]:
    return ["bfloat16", "float16", "float32"] if device == "cuda" else ["float32"]


def inputs(case: Shape, dtype: str, device: str) -> Any:
    """The case's tensors as one attention call: drawn on the host (every device and dtype sees the same numbers,
    and every backend the same call), each requiring grad."""
    from attnkit.runtime.call import Inputs

    t = make_inputs(replace(case, dtype=dtype), device, host_rng=True, requires_grad=True)
    return Inputs(t.q, t.k, t.v, **t.kw)


def check(backend: str, case_name: str, dtype: str, device: str) -> dict[str, Any]:
    """One backend (or AUTO) on one case and dtype: forward and backward against the float64 reference."""
    import torch

    from attnkit.runtime.attention import attention
    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.probe import probe
    from attnkit.runtime.select import SELECTOR, NoBackendError, fell_back, select

    entry: dict[str, Any] = {"backend": backend, "case": case_name, "dtype": dtype}
    inp = inputs(CASES[case_name], dtype, device)
    t0 = time.perf_counter()
    try:
        call, params = inp.prepare()
        fn: Any = None
        runner: Any = None
        if backend == COMPILED:
            if case_name not in COMPILED_CASES:
                return {**entry, "outcome": "skipped", "reason": f"{COMPILED}: run on {', '.join(COMPILED_CASES)}"}
            SELECTOR.reset()  # an earlier row's fallback must not decide this row's pick (SELECTOR.judged_pick)
            try:
                # the graph below is compiled with dynamic=True: its pick is made for that call (flex, say, is
                # refused there), not for these tensors' static sizes
                entry["selected"] = select(replace(inp.describe("compile"), symbolic=True, dynamic=True)).name
            except NoBackendError as exc:
                return {**entry, "outcome": "skipped", "reason": f"{COMPILED}: {_refusal(exc)}"}
            kw = _kwargs(inp)
            # one lambda's code object serves every check: without a reset, dynamo's recompile limit (8 graphs
            # per code object) ends the compiled rows after eight (FailOnRecompileLimitHit under fullgraph).
            # dynamic=True: every size symbolic, as a model compiled for varying lengths has them
            torch._dynamo.reset()
            fn = torch.compile(lambda q, k, v: attention(q, k, v, **kw), fullgraph=True, backend="aot_eager",
                               dynamic=True)
            out = fn(inp.q, inp.k, inp.v)
        elif backend == AUTO:
            with SELECTOR.judged_pick() as fell:
                try:
                    entry["selected"] = select(call).name
                except NoBackendError as exc:
                    return {**entry, "outcome": "skipped", "reason": f"{AUTO}: {_refusal(exc)}"}
                out = attention(inp.q, inp.k, inp.v, **_kwargs(inp))
            entry["fallback_route" if fell else "route"] = _bound_route(call)  # fell: the next candidate's
            if fell:  # the pick raised and another backend answered: this machine's pick does not work here
                entry.update(outcome="failed", error=fell_back(fell), seconds=round(time.perf_counter() - t0, 4))
                return entry
        else:
            why = REGISTRY[backend].check(call, probe())
            if why:
                return {**entry, "outcome": "skipped", "reason": f"{backend}: {'; '.join(why)}"}
            runner = REGISTRY[backend].bind(call, params, inp.q, inp.k, inp.v)
            entry["route"] = route(runner)
            out = runner(inp.q, inp.k, inp.v)
        ref, refs, g = _reference(case_name, dtype, device)
        fwd_tol, bwd_tol = TOL[dtype]
        problems = []
        if out.shape != ref.shape:
            problems.append(f"output shape {tuple(out.shape)} != {tuple(ref.shape)}")
        elif not torch.isfinite(out).all():
            problems.append("output has NaN/inf")
        else:
            entry["fwd_err"] = err = (out.double() - ref).abs().max().item()
            if err > fwd_tol:
                problems.append(f"forward max error {err:.3g} > {fwd_tol}")
            # the output gradient twice, in two memory layouts: a kernel whose backward depends on dO's strides
            # (cuDNN on torch 2.11, issue 21) is caught whatever layout the caller's loss happens to produce
            go = g.to(out.dtype)
            entry["bwd_err"] = {}
            for label, grad_out in (("", go), (" (dO in another layout)", _other_layout(go))):
                if label:  # one backward per forward: a compiled backward (flex's, a graph's) donates its
                    # buffers, so a second backward through one graph (retain_graph) is refused by torch
                    out = (fn(inp.q, inp.k, inp.v) if fn is not None else
                           attention(inp.q, inp.k, inp.v, **_kwargs(inp)) if backend == AUTO else
                           runner(inp.q, inp.k, inp.v))
                grads = torch.autograd.grad(out, (inp.q, inp.k, inp.v), grad_out)
                for name, a, b in zip("qkv", grads, refs, strict=True):
                    if not torch.isfinite(a).all():
                        problems.append(f"d{name} has NaN/inf{label}")
                        continue
                    e = (a.double() - b).abs().max().item()
                    entry["bwd_err"][name] = max(e, entry["bwd_err"].get(name, 0.0))
                    if e > bwd_tol:
                        problems.append(f"d{name} max error {e:.3g} > {bwd_tol}{label}")
        entry.update(outcome="failed" if problems else "passed", seconds=round(time.perf_counter() - t0, 4))
        if problems:
            entry["error"] = "; ".join(problems)
    except Exception as exc:  # a kernel that raises is a failed check, reported, not a crash of the run
        first = first_line(exc, 300)
        entry.update(outcome="failed", error=f"{type(exc).__name__}: {first}",
                     seconds=round(time.perf_counter() - t0, 4))
    return entry


def route(runner: Any) -> str:
    """Which way a bound runner reaches its kernel, by the function bind() returned: e.g. `_direct.run_flash` (the
    kernel's op called directly), `SdpaBackend._forced.forced` (inside the sdpa_kernel context)."""
    name = getattr(runner, "__qualname__", None) or type(runner).__qualname__
    return name.replace(".<locals>", "")


def _bound_route(call: Any) -> str | None:
    """attention()'s own route for `call`: the runner it bound (None where it bound none: a call it cannot cache)."""
    from attnkit.runtime import dispatch

    hit = next((b for b in reversed(dispatch.bound_calls()) if b.call == call
                and (b.call.lengths_q, b.call.lengths_k) == (call.lengths_q, call.lengths_k)), None)
    return None if hit is None else route(hit.runner)


def _refusal(exc: Exception) -> str:
    """A NoBackendError in one line: its head (the call). Each backend's own reason is its forced row's skip."""
    return str(exc).splitlines()[0].rstrip(":") + " (each backend's reason: its own row)"


def _other_layout(t: Any) -> Any:
    """The same values with the first two dimensions swapped in memory (heads-major for varlen)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() >= 2 else t


@functools.cache
def _reference(case_name: str, dtype: str, device: str) -> tuple[Any, tuple[Any, ...], Any]:
    """The float64 output, the output gradient used, and the input gradients, for one case: computed once and
    shared by every backend (they all see the same seeded numbers)."""
    import torch

    from attnkit.runtime.reference import reference_attention

    inp = inputs(CASES[case_name], dtype, device)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    ref = reference_attention(q64, k64, v64, **_kwargs(inp, reference=True))
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(ref.device).double()
    grads = torch.autograd.grad(ref, (q64, k64, v64), g)
    return ref.detach(), tuple(x.detach() for x in grads), g


def _kwargs(inp: Any, reference: bool = False) -> dict[str, Any]:
    names = ["causal", "window", "softcap", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k"]
    if not reference:
        names += ["max_seqlen_q", "max_seqlen_k"]
    kw = {n: getattr(inp, n) for n in names}
    return {n: val for n, val in kw.items() if val is not None}


def run_smoke(report: str | None = None, backends: list[str] | None = None, cases: list[str] | None = None,
              quiet: bool = False) -> int:
    """Every (backend, case, dtype), then attention() itself; 0 when nothing failed, 1 otherwise."""
    import json

    from rich.console import Console

    from attnkit._io import write_atomic
    from attnkit.errors import UsageError
    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.doctor import report as doctor_report
    from attnkit.runtime.probe import probe

    for name in backends or []:
        if name not in REGISTRY and name not in (AUTO, COMPILED):
            raise UsageError(f"--backend: unknown backend {name!r}; known: {', '.join([*REGISTRY, AUTO, COMPILED])}")
    for name in cases or []:
        if name not in CASES:
            raise UsageError(f"--case: unknown case {name!r}; known: {', '.join(CASES)}")
    con = Console(width=160, quiet=quiet)
    interrupted: dict[str, int] = {}  # what a KeyboardInterrupt (Ctrl-C, or a time limit's TERM) left: in the report
    p = probe()
    if p.torch is None:
        why = p.torch_error or "torch is not installed"
        checks = [{"backend": b, "outcome": "skipped", "reason": f"{why}: no attention backend can run"}
                  for b in backends or [*REGISTRY, AUTO, COMPILED]]
    else:
        device = "cuda" if p.has_gpu and p.torch.cuda_available else "cpu"
        # one process, dozens of flex signatures: past dynamo's recompile limit (8) flex's block masks are made
        # uncompiled (2026-12-06, the H100's smoke: create_block_mask at its limit), which no model's process sees
        from attnkit.runtime.backends.flex import allow_many_signatures

        allow_many_signatures()
        checks = []
        planned = [(b, c, dt) for b in backends or [*REGISTRY, AUTO, COMPILED] for c in cases or list(CASES)
                   for dt in dtypes(device)]
        try:
            for b, c, dt in planned:
                checks.append(check(b, c, dt, device))
                last = checks[-1]
                if last["outcome"] == "failed":
                    con.print(f"[red]FAILED[/red] {b} {c} {dt}: {last['error']}")
        except KeyboardInterrupt:  # a time limit's TERM (the CLI raises it): the rows done are reported, then it stops
            interrupted = {"not_run": len(planned) - len(checks), "planned": len(planned)}
    counts: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for ch in checks:
        counts[ch["outcome"]] = counts.get(ch["outcome"], 0) + 1
        if ch["outcome"] == "skipped":
            skipped[ch["reason"]] = skipped.get(ch["reason"], 0) + 1
    by_backend: dict[str, dict[str, int]] = {}
    for ch in checks:
        row = by_backend.setdefault(ch["backend"], {})
        row[ch["outcome"]] = row.get(ch["outcome"], 0) + 1
    routes: dict[str, Counter[str]] = {}  # per backend: how its rows reached their kernels (route())
    for ch in checks:
        if ch.get("route"):
            routes.setdefault(ch["backend"], Counter())[ch["route"]] += 1
    con.print(f"smoke: {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
              f"{counts.get('skipped', 0)} skipped (with reasons)"
              + (f"; [red]interrupted: {interrupted['not_run']} of {interrupted['planned']} checks not run[/red]"
                 if interrupted else ""))
    con.print("  " + "; ".join(f"{b}: " + ", ".join(f"{n} {o}" for o, n in sorted(r.items()))
                              for b, r in by_backend.items()))
    for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]):  # one line per reason, with its count
        con.print(f"  skipped {n}x: {reason}")
    if report:
        doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "counts": counts,
               "by_backend": by_backend, "routes": routes, "skipped_reasons": skipped, "doctor": doctor_report(), "checks": checks}
        if interrupted:  # a partial report says so: its counts are of the checks that ran, in the planned order
            doc["interrupted"] = interrupted
        write_atomic(Path(report), json.dumps(doc, indent=1, default=str))
        con.print(f"wrote {report}")
    if interrupted:  # interrupted is never a pass: the CLI says so and exits 130
        raise KeyboardInterrupt
    if counts.get("failed"):
        return 1
    if not counts.get("passed"):  # a gate that checked nothing must not pass
        con.print("[red]smoke: no check ran on this machine[/red]")
        return 1
    return 0
