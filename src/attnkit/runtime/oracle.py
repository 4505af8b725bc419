"""`attnkit oracle` (run by `nox -s oracle`): flash-attn's own test grid, judged by flash-attn's own reference and
tolerance rule, for attention()'s own pick AND for every backend forced, forward and backward.

Why a product check and not a one-off: which kernel a call reaches depends on the machine, the libraries and
even on what ran before (issue 21: cuDNN's backward went wrong only once a graph of the same sizes had been
built with another output-gradient layout). A backend that claims a case must pass it; one that cannot must
refuse it through its limits, never answer wrongly.

The reference functions (attention_ref, construct_local_mask, attn_bias_from_alibi_slopes,
generate_random_padding_mask) are read at run time from the flash-attention tests file the user points to;
nothing of theirs is stored here. The rule is theirs: output error <= 2x, each gradient error <= 3x the error of
the same math done by PyTorch in the low precision (reordered ops), both against the fp32 reference.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnkit.errors import UsageError, first_line, shown

AUTO = "attnkit"  # attention()'s own pick
REFERENCE = ("attention_ref", "construct_local_mask", "attn_bias_from_alibi_slopes", "generate_random_padding_mask")
HEADS = {"mha": 6, "mqa": 1, "gqa": 2}  # kv heads for 6 query heads, as flash-attn's tests
DIMS = (32, 59, 64, 111, 128, 256)
PAIRS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
         (1024, 1023), (2048, 2048))
# softcap: FlashAttention-4's tests (tests/cute) cover it, flash-attn 2's output grid above does not
SOFTCAP, SOFTCAP_DIMS, SOFTCAP_PAIRS = 50.0, (64, 128), ((113, 203), (512, 256), (1024, 1024))


@dataclass(frozen=True)
class Case:
    layout: str  # "dense" | "varlen" (random padding per sequence, packed)
    dtype: str
    heads: str  # key of HEADS
    causal: bool
    local: bool
    alibi: bool
    softcap: float
    d: int
    sq: int
    sk: int

    @property
    def tag(self) -> str:
        cap = f" softcap={self.softcap:g}" if self.softcap else ""
        return (f"{self.layout} {self.dtype} {self.heads} causal={self.causal} local={self.local} alibi={self.alibi}"
                f"{cap} d={self.d} sq={self.sq} sk={self.sk}")

    @property
    def group(self) -> tuple[Any, ...]:
        """What a JIT backend compiles a kernel for: shards split by it, so no two shards compile the same."""
        return (self.layout, self.dtype, self.heads, self.causal, self.local, self.alibi, self.softcap, self.d)


def grid() -> list[Case]:
    """flash-attn's test_flash_attn_output / test_flash_attn_varlen_output grid (no dropout), plus softcap cases;
    interleaved so that a time budget still samples every feature."""
    base = [Case(lay, dt, h, c, lo, al, 0.0, d, sq, sk) for lay, dt, h, c, lo, al, d, (sq, sk) in itertools.product(
        ("dense", "varlen"), ("bfloat16", "float16"), HEADS, (False, True), (False, True), (False, True), DIMS, PAIRS)]
    base += [Case(lay, dt, h, c, lo, False, SOFTCAP, d, sq, sk) for lay, dt, h, c, lo, d, (sq, sk) in itertools.product(
        ("dense", "varlen"), ("bfloat16", "float16"), HEADS, (False, True), (False, True), SOFTCAP_DIMS, SOFTCAP_PAIRS)]
    return base[::7] + [c for i, c in enumerate(base) if i % 7]


@functools.cache
def grid_size() -> int:
    return len(grid())


@functools.cache
def group_index() -> dict[tuple[Any, ...], int]:
    """Each kernel configuration of the grid (Case.group) numbered in first-seen order: the unit of shards and
    claims."""
    return {g: n for n, g in enumerate(dict.fromkeys(c.group for c in grid()))}


def select_cases(cases: list[Case], shard: tuple[int, int] | None, words: list[str] | None) -> list[Case]:
    if words:
        cases = [c for c in cases if all(w in c.tag for w in words)]
    if shard is not None:
        index, count = shard
        cases = [c for c in cases if group_index()[c.group] % count == index - 1]
    return cases


def by_group_heaviest_first(cases: list[Case]) -> list[Case]:
    """The cases one configuration after another, the costliest configurations first (cost ~ the score matrix's
    elements x head dim, summed): processes that claim configurations as they reach them then finish together,
    the last ones taking the small configurations (the grid's interleaved order would hand out nearly every
    configuration within its first seventh, fixing each process's share at the start)."""
    cost: dict[tuple[Any, ...], int] = {}
    for c in cases:
        cost[c.group] = cost.get(c.group, 0) + c.sq * c.sk * c.d
    return sorted(cases, key=lambda c: (-cost[c.group], group_index()[c.group]))


def claim(claims: Path, group: int, worker: str = "") -> bool:
    """Take kernel configuration `group` for this process: True once, for the first process that asks. Static
    shards finish unevenly (2026-12-01, H200: 212-436 s for 16 shards of one grid, the same 94 varlen cases never
    reached in two sessions); workers that claim groups from one folder all stay busy until the grid is done."""
    try:
        fd = os.open(claims / str(group), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:  # who took it: a worker that died after claiming is named by its claims
        os.write(fd, worker.encode())
    finally:
        os.close(fd)
    return True


def load_reference(path: str) -> dict[str, Any]:
    """flash-attn's reference functions from its tests file (or a checkout holding tests/test_flash_attn.py)."""
    import torch

    p = Path(path)
    try:
        if p.is_dir():
            p = p / "tests" / "test_flash_attn.py"
        found = p.is_file()
    except OSError as exc:  # a name too long for the file system, ...
        raise UsageError(f"--tests: {path[:200]}: {exc.strerror or exc}") from None
    if not found:
        raise UsageError(f"--tests: {path[:200]}: no such file; give flash-attention's tests/test_flash_attn.py "
                         "(or a checkout that holds it)")
    try:
        import einops
    except ImportError:
        raise UsageError("--tests: flash-attn's reference needs einops: pip install einops") from None
    try:
        tree = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
    except (SyntaxError, UnicodeDecodeError, OSError, MemoryError, RecursionError) as exc:
        raise UsageError(f"--tests: {p}: cannot be read as Python ({type(exc).__name__})") from None
    ns: dict[str, Any] = {"torch": torch, "math": math, "rearrange": einops.rearrange, "repeat": einops.repeat,
                          "F": torch.nn.functional}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in REFERENCE:
            exec(compile(ast.Module([node], []), str(p), "exec"), ns)
    missing = [n for n in REFERENCE if n not in ns]
    if missing:
        raise UsageError(f"--tests: {p} defines no {', '.join(missing)}: is it flash-attention's "
                         "tests/test_flash_attn.py?")
    ns["__file__"], ns["__sha256__"] = str(p), hashlib.sha256(p.read_bytes()).hexdigest()
    return ns


def _judge(name: str, a: Any, ref: Any, low: Any) -> list[float]:
    """[error, allowed] for one output under flash-attn's rule: within 2x (output) or 3x (gradients) the error of
    the same computation in the low precision, plus 1e-5."""
    def e(x: Any, y: Any) -> float:
        return (x.float() - y.float()).abs().max().item()

    return [round(e(a, ref), 5), round((2 if name.startswith("out") else 3) * e(low, ref) + 1e-5, 5)]


def _errors(out: Any, grads: tuple[Any, ...], ref: tuple[Any, ...], low: tuple[Any, ...]) -> dict[str, list[float]]:
    """name -> [error, allowed] under flash-attn's rule."""
    names = ("out", "dq", "dk", "dv")
    return {n: _judge(n, a, r, lo) for n, a, r, lo in zip(names, (out, *grads), ref, low, strict=True)}


def run_case(case: Case, ref: dict[str, Any], backends: list[str], device: str) -> dict[str, Any]:
    """One case: the references once, then each backend (AUTO = attention()'s pick) forward and backward; the
    own pick also forward alone without gradients (`_inference`)."""
    import torch
    from einops import rearrange

    from attnkit.runtime.attention import attention
    from attnkit.runtime.call import Inputs
    from attnkit.runtime.select import SELECTOR, NoBackendError

    torch.random.manual_seed(0)
    dt = getattr(torch, case.dtype)
    b, h, hk = 4, 6, HEADS[case.heads]
    q = torch.randn(b, case.sq, h, case.d, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(b, case.sk, hk, case.d, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(b, case.sk, hk, case.d, device=device, dtype=dt, requires_grad=True)
    window = tuple(int(x) for x in torch.randint(0, case.sk, (2,))) if case.local else (-1, -1)
    qmask: Any = None
    kmask: Any = None
    if case.layout == "varlen":
        qmask = ref["generate_random_padding_mask"](case.sq, b, device, mode="random")
        kmask = ref["generate_random_padding_mask"](case.sk, b, device, mode="random")
    slopes = torch.rand(b, h, device=device, dtype=torch.float32) * 0.3 if case.alibi else None
    bias = (ref["attn_bias_from_alibi_slopes"](slopes, case.sq, case.sk, qmask, kmask, causal=case.causal)
            if case.alibi else None)
    kw = {"attn_bias": bias, "causal": case.causal, "window_size": window, "softcap": case.softcap}
    out_ref, _ = ref["attention_ref"](q, k, v, qmask, kmask, **kw)
    out_low, _ = ref["attention_ref"](q, k, v, qmask, kmask, **kw, upcast=False, reorder_ops=True)
    g = torch.randn_like(out_ref)
    if qmask is not None:
        g = g.masked_fill(rearrange(~qmask, "b s -> b s 1 1"), 0.0)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), g)
    grads_low = torch.autograd.grad(out_low, (q, k, v), g)
    ours: dict[str, Any] = {"causal": case.causal, "window": window if case.local else None, "alibi_slopes": slopes,
            "softcap": case.softcap}

    packed: dict[str, Any] = {}
    if qmask is not None:  # the packing, worked out once per case (each backend gets its own graph through it)
        packed = {"iq": qmask.flatten().nonzero().flatten(), "ik": kmask.flatten().nonzero().flatten(),
                  "cu_seqlens_q": torch.nn.functional.pad(qmask.sum(-1).cumsum(0), (1, 0)).to(torch.int32),
                  "cu_seqlens_k": torch.nn.functional.pad(kmask.sum(-1).cumsum(0), (1, 0)).to(torch.int32),
                  "max_seqlen_q": int(qmask.sum(-1).max()), "max_seqlen_k": int(kmask.sum(-1).max())}

    def inputs() -> Inputs:
        if not packed:
            return Inputs(q, k, v, **ours)
        lens = {n: packed[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
        return Inputs(q.reshape(b * case.sq, h, case.d).index_select(0, packed["iq"]),
                      k.reshape(b * case.sk, hk, case.d).index_select(0, packed["ik"]),
                      v.reshape(b * case.sk, hk, case.d).index_select(0, packed["ik"]), **lens, **ours)

    def call(backend: str | None) -> Any:
        inp = inputs()
        o = attention(inp.q, inp.k, inp.v, backend=backend, **{n: getattr(inp, n) for n in (*ours, *packed) if n[0] != "i"})
        if not packed:
            return o
        return torch.zeros(b * case.sq, h, case.d, device=device, dtype=o.dtype).index_copy(0, packed["iq"], o).reshape(
            b, case.sq, h, case.d)

    results: dict[str, Any] = {}
    for name in backends:
        try:
            judged: contextlib.AbstractContextManager[list[str]] = (
                SELECTOR.judged_pick() if name == AUTO else contextlib.nullcontext([]))  # a forced one never falls back
            with judged as fell:
                out = call(None if name == AUTO else name)
                grads = torch.autograd.grad(out, (q, k, v), g)
            if fell:  # the pick raised and the next candidate answered: a failure of the pick, whatever the numbers
                results[name] = {"outcome": "fail", **_fell(fell)}
                continue
        except NoBackendError as exc:
            lines = str(exc).splitlines()
            results[name] = {"outcome": "refused", "reason": lines[-1].split(": ", 1)[-1] if len(lines) > 1 else lines[0]}
            continue
        except Exception as exc:  # a backend that claims a case and then raises has failed it
            first = first_line(exc)
            results[name] = {"outcome": "fail", "error": f"{type(exc).__name__}: {first}"}
            continue
        errs = _errors(out, grads, (out_ref, *grads_ref), (out_low, *grads_low))
        inference: dict[str, Any] = {}
        if name == AUTO:  # the same call with no gradient asked: forward-only rows pick other backends
            inference = _inference(call, inputs, out_ref, out_low)
            if "out" in inference:
                errs["out (no grad)"] = inference["out"]
        over = {n: ea for n, ea in errs.items() if not ea[0] <= ea[1]}
        results[name] = {"outcome": "fail", "over": over} if over else {"outcome": "pass"}
        if name == AUTO:
            if "error" in inference:  # the forward alone raised or fell back: a fail, the grad pass's errors kept
                results[name].update(outcome="fail", error=inference["error"])
            results[name]["selected"] = _selected(inputs())
            results[name]["selected_forward"] = inference["selected"]
    return {"case": case.tag, "results": results}


def _inference(call: Any, inputs: Any, out_ref: Any, out_low: Any) -> dict[str, Any]:
    """attention()'s own pick for the case's forward alone (no_grad, as inference runs it): {"out": [error,
    allowed], "selected": backend}, or {"error": ..., "selected": backend} when it raised or fell back to the next
    candidate. No backend for the forward alone (NoBackendError) is a fail too: the same call with gradients was
    served, and inference needs no more than training."""
    import torch

    from attnkit.runtime.select import SELECTOR

    with torch.no_grad():
        selected = _selected(inputs())
        try:
            with SELECTOR.judged_pick() as fell:
                out = call(None)
        except Exception as exc:  # a pick that raises on the forward alone has failed the case
            return {"error": f"forward without grad: {type(exc).__name__}: {first_line(exc)}", "selected": selected}
        if fell:
            return _fell(fell, "forward without grad: ")
        return {"out": _judge("out", out, out_ref, out_low), "selected": selected}


def _fell(fell: list[str], where: str = "") -> dict[str, str]:
    """A pick that raised and was answered by the next candidate: the verdict, and the pick that raised."""
    from attnkit.runtime.select import fell_back

    return {"error": f"{where}{fell_back(fell)}", "selected": fell[0].split(":")[0]}


def _selected(inp: Any) -> str:
    """The backend attention() picked (the first candidate; a run-time fallback is not followed)."""
    from attnkit.runtime.select import select

    try:
        return select(inp.describe()).name
    except Exception as exc:  # reported, not raised: the run itself already went through
        return f"? {type(exc).__name__}"


def counts(cases: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c in cases:
        for name, r in c["results"].items():
            row = out.setdefault(name, {"pass": 0, "fail": 0, "refused": 0})
            row[r["outcome"]] += 1
    return out


def run_oracle(tests: str, out: str | None = None, budget: float = 600.0, shard: tuple[int, int] | None = None,
               backends: list[str] | None = None, words: list[str] | None = None, quiet: bool = False,
               forced_budget: float | None = None, claims: str | None = None, resume: list[str] | None = None) -> int:
    """Run the grid (or a shard of it) within `budget` seconds; 1 if any backend answered a case wrongly.
    After `forced_budget` seconds the remaining cases run attention()'s own pick only: the check users rely on
    covers the whole grid even where a budget leaves the forced backends a sample of it. With `claims` (a
    folder shared by the processes of one pass) each process runs the kernel configurations it claims first
    (see claim()) instead of a fixed shard. `resume`: earlier reports of this grid; the cases they answered for
    every backend run here are left out (a pass cut by its budget goes on where it stopped; --merge joins them)."""
    import torch

    from attnkit._io import write_atomic
    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.probe import probe

    ref = load_reference(tests)
    from attnkit.runtime.backends.flex import allow_many_signatures

    allow_many_signatures()
    for name in backends or []:
        if name not in REGISTRY and name != AUTO:
            raise UsageError(f"--backend: unknown backend {name!r}; known: {', '.join([AUTO, *REGISTRY])}")
    p = probe()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wanted = backends or [AUTO, *REGISTRY]
    unavailable = {n: REGISTRY[n].unavailable(p) for n in wanted if n != AUTO}
    run = [n for n in wanted if n == AUTO or not unavailable[n]]
    claim_dir = None
    if claims is not None:
        if shard is not None:
            raise UsageError("--claims: takes the place of --shard (the processes share the grid); give one of them")
        claim_dir = Path(claims)
        try:  # a claim file made and removed: a folder claims cannot be written to is refused before any case
            claim_dir.mkdir(parents=True, exist_ok=True)
            probe_file = claim_dir / f".probe-{os.getpid()}"
            probe_file.touch()
            probe_file.unlink()
        except OSError as exc:
            raise UsageError(f"--claims: {shown(claims)}: not a folder claims can be written to "
                             f"({exc.strerror or type(exc).__name__})") from None
    here = {"tests_sha256": ref["__sha256__"], "device": device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    earlier = answered(resume, run, here) if resume else set()
    cases = select_cases(grid(), shard, words)
    if device == "cpu":  # a dry run: small cases a CPU does in seconds
        cases = [c for c in cases if c.sq <= 128 and c.sk <= 256 and c.d in (32, 59) and c.dtype == "float16"]
    # the pass's whole selection; a claiming or a resumed run is one part of it (merge takes the largest, not a sum)
    whole = len(cases)
    cases = [c for c in cases if c.tag not in earlier]
    worker = uuid.uuid4().hex[:12]
    if claim_dir is not None:
        cases = by_group_heaviest_first(cases)
    groups = group_index()
    mine: dict[int, bool] = {}
    t0, done, skipped, own_only, taken = time.monotonic(), [], 0, 0, 0
    for case in cases:
        spent = time.monotonic() - t0
        if claim_dir is not None:
            g = groups[case.group]
            if g not in mine:  # once the budget is spent a process claims nothing: the rest is the pass's leftover
                mine[g] = spent <= budget and claim(claim_dir, g, worker)
            if not mine[g]:
                continue
            taken += 1
        if spent > budget:
            skipped += 1
            continue
        names = run
        if forced_budget is not None and spent > forced_budget and AUTO in run:
            names, own_only = [AUTO], own_only + 1
        done.append(run_case(case, ref, names, device))
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tests_file": ref["__file__"],
           "tests_sha256": ref["__sha256__"], "torch": torch.__version__, "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "rule": "output error <= 2x, gradient errors <= 3x the error of PyTorch's low-precision math "
                   "(flash-attn's tests), both against the fp32 reference",
           "shard": list(shard) if shard else None, "backends": run, "filter": words, "budget_s": budget,
           **({"resumed": {"reports": list(resume), "cases_answered": len(earlier)}} if resume else {}),
           "seconds": round(time.monotonic() - t0, 1), "grid_cases": taken if claim_dir else len(cases),
           "skipped_budget": skipped, **({"claims": str(claim_dir), "worker": worker} if claim_dir else {}),
           **({"pass_grid_cases": whole} if claim_dir or resume else {}),
           "forced_budget_s": forced_budget, "own_pick_only": own_only,
           "unavailable": {n: r for n, r in unavailable.items() if r}, "counts": counts(done), "cases": done}
    if out:
        write_atomic(Path(out), json.dumps(doc, indent=1))
    _print(doc, quiet, out)
    return 1 if any(r["fail"] for r in doc["counts"].values()) else 0


def merge(paths: list[str], out: str | None, quiet: bool = False) -> int:
    """Shard reports -> one report (cases by tag, counts recomputed); 1 if any case failed."""
    from attnkit._io import write_atomic

    docs = [read_report(path, "--merge") for path in paths]
    by_tag: dict[str, dict[str, Any]] = {}
    for d in docs:  # one case from several reports (an own-pick pass and a forced pass): its results joined,
        for c in d["cases"]:  # a later report's result for a backend replacing an earlier one
            by_tag.setdefault(c["case"], {"case": c["case"], "results": {}})["results"].update(c["results"])
    cases = list(by_tag.values())
    # a re-run shard: its last report; claiming processes, and a run resuming earlier ones, are one part each
    latest = {(tuple(d.get("backends") or ("?",)), str(d.get("shard")), str(d.get("claims")), str(d.get("worker")),
               str(d.get("resumed"))): d
              for d in (part for doc in docs for part in pass_parts(doc))}
    # reports of one backend list are the parts of one pass: its cases counted once each (shards from two sessions
    # or a claiming pass beside a sharded one overlap), its size the sum of its distinct shards or, for claiming
    # processes, the selection they shared; what no part ran is left by the budget
    parts: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for d in latest.values():
        parts.setdefault(tuple(d.get("backends") or ("?",)), []).append(d)
    passes: dict[tuple[str, ...], dict[str, Any]] = {}
    for key, ds in parts.items():
        tags = {c["case"] for d in ds for c in d["cases"]}
        sharded = sum(d.get("grid_cases", len(d["cases"])) for d in ds if "pass_grid_cases" not in d)
        shared = max((d["pass_grid_cases"] for d in ds if "pass_grid_cases" in d), default=0)
        size = max(sharded, shared, len(tags))
        passes[key] = {"backends": list(key), "grid_cases": size, "cases": len(tags),
                       "skipped_budget": size - len(tags)}
    grid_cases = max(p["grid_cases"] for p in passes.values())
    doc = {**{k: v for k, v in docs[0].items()
              if k not in ("cases", "counts", "shard", "backends", "claims", "worker", "pass_grid_cases")},
           "merged": [{"shard": d.get("shard"), "worker": d.get("worker"), "backends": d.get("backends"),
                       "seconds": d.get("seconds"),
                       "cases": len(d["cases"]), "skipped_budget": d.get("skipped_budget"),
                       "own_pick_only": d.get("own_pick_only", 0)} for d in docs],
           "passes": list(passes.values()), "grid_cases": grid_cases,
           "unavailable": {n: why for d in docs for n, why in (d.get("unavailable") or {}).items()},
           "own_pick_only": sum(d.get("own_pick_only", 0) for d in docs),
           "seconds": max(d.get("seconds", 0) for d in docs),
           "skipped_budget": max(0, grid_cases - len(cases)),  # cases no pass reached
           "counts": counts(cases), "cases": cases}
    if out:
        write_atomic(Path(out), json.dumps(doc, indent=1))
    _print(doc, quiet, out)
    return 1 if any(r["fail"] for r in doc["counts"].values()) else 0


def pass_parts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A report as parts of its passes: a run's report is one part; a merged one (what --resume continues) one
    part per pass it lists, holding that pass's cases, so merging it again keeps which pass covered what."""
    passes = doc.get("passes")
    if "merged" not in doc or not isinstance(passes, list) or not all(
            isinstance(p, dict) and isinstance(p.get("backends"), list) and isinstance(p.get("grid_cases"), int)
            for p in passes):
        return [doc]
    return [{"backends": p["backends"], "shard": "merged", "pass_grid_cases": p["grid_cases"],  # a whole pass:
             "cases": [c for c in doc["cases"] if set(p["backends"]) <= set(c["results"])]}  # its size, not a part's
            for p in passes]


def read_report(path: str, flag: str) -> dict[str, Any]:
    """An oracle report, checked as far as merge() and --resume read it; a one-line error naming `flag` if not."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"{flag}: {shown(path)}: not a readable oracle report ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        raise UsageError(f"{flag}: {shown(path)}: not an oracle report (no 'cases' list)")
    bad = next((i for i, c in enumerate(doc["cases"]) if not (
        isinstance(c, dict) and isinstance(c.get("case"), str) and isinstance(c.get("results"), dict)
        and all(isinstance(r, dict) and r.get("outcome") in ("pass", "fail", "refused")
                for r in c["results"].values()))), None)
    if bad is not None:
        raise UsageError(f"{flag}: {shown(path)}: cases[{bad}] is not an oracle case (a 'case' tag and 'results' "
                         "whose outcomes are pass, fail or refused)")
    field = _bad_report_field(doc)
    if field:
        raise UsageError(f"{flag}: {shown(path)}: {field} is not what `attnkit oracle` writes")
    return doc


def answered(paths: list[str], backends: list[str], here: dict[str, Any]) -> set[str]:
    """The cases that earlier reports hold an outcome for, for every one of `backends` (what --resume skips).
    A report of another tests file, device, GPU or torch answered other questions under the same tags: refused."""
    tags: dict[str, set[str]] = {}
    for path in paths:
        doc = read_report(path, "--resume")
        for key, what in (("tests_sha256", "tests file (sha256)"), ("device", "device"), ("gpu", "GPU"),
                          ("torch", "torch")):
            if doc.get(key) != here[key]:
                raise UsageError(f"--resume: {shown(path)}: ran on another {what} ({str(doc.get(key))[:24]}; this "
                                 f"run: {str(here[key])[:24]}); resume from reports of the same set-up")
        for c in doc["cases"]:
            # an own pick from before the forward-alone check (no `selected_forward`) has not answered it yet,
            # unless its pass with gradients already refused or raised
            tags.setdefault(c["case"], set()).update(
                n for n, r in c["results"].items()
                if n != AUTO or "selected_forward" in r or "error" in r or r.get("outcome") == "refused")
    return {t for t, names in tags.items() if set(backends) <= names}


def _bad_report_field(d: dict[str, Any]) -> str | None:
    """The first report field merge() reads that has the wrong type (None: all as run_oracle writes them)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

    backends = d.get("backends")
    if backends is not None and not (isinstance(backends, list) and all(isinstance(b, str) for b in backends)):
        return "backends"
    for name in ("grid_cases", "skipped_budget", "own_pick_only", "seconds", "pass_grid_cases"):
        if name in d and not number(d[name]):
            return name
    if "worker" in d and not isinstance(d["worker"], str):
        return "worker"
    whole = d.get("pass_grid_cases", 0)
    if isinstance(whole, bool) or not isinstance(whole, int) or not 0 <= whole <= grid_size():
        return "pass_grid_cases"  # the size of a selection of the grid
    una = d.get("unavailable")
    if una is not None and not (isinstance(una, dict) and all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in una.values())):
        return "unavailable"
    return None


def _print(doc: dict[str, Any], quiet: bool, out: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=150, quiet=quiet)
    own = f" ({doc['own_pick_only']} of them by the own pick only)" if doc.get("own_pick_only") else ""
    table = Table(title=f"flash-attn's test grid: {len(doc['cases'])} cases run{own}, {doc['skipped_budget']} left "
                        f"by the budget, {doc['seconds']} s")
    for col in ("backend", "pass", "fail", "refused"):
        table.add_column(col)
    for name, row in doc["counts"].items():
        table.add_row(name, str(row["pass"]), f"[red]{row['fail']}[/red]" if row["fail"] else "0", str(row["refused"]))
    con.print(table)
    for name, why in doc.get("unavailable", {}).items():
        con.print(f"  {name}: not run here ({'; '.join(why)})")
    for c in doc["cases"]:
        for name, r in c["results"].items():
            if r["outcome"] == "fail":
                con.print(f"[red]WRONG[/red] {name}: {c['case']}: {r.get('over') or r.get('error')}")
    if out:
        con.print(f"wrote {out}")


__all__ = ["AUTO", "Case", "grid", "load_reference", "merge", "run_oracle", "select_cases"]
