"""`attnkit bench --integrations` (or `python -m attnkit.bench.integrations`): attnkit where people train, on a GPU, side by side in one process.

1. A random-weight Llama-architecture model (GQA) in bf16: one training step (forward + backward) timed with
   HF's "sdpa" and attnkit, eager and torch.compile'd (inductor, fullgraph), and "flash_attention_2" where
   flash-attn is installed; the losses are compared so a fast wrong step cannot win.
2. The chosen kernel is in the compiled graph: the CUDA kernels of one attention fwd+bwd, eager vs compiled.
3. CUDA-graph decode: one decode step (one query against a fixed-size KV cache) captured with
   torch.cuda.graph and replayed with new inputs each time, every replay compared with eager; then every
   backend that can serve the call is captured on its own: which are capture-safe.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from attnkit.bench.timer import median_seconds
from attnkit.errors import first_line


def _median_ms(step: Any, iters: int, warmup: int = 3) -> float:
    return median_seconds(step, "cuda", warmup=warmup, iters=iters) * 1e3


BATCHES = ("full", "padded", "packed")


def batch_of(kind: str, batch: int, tokens: int, vocab: int, device: str) -> dict[str, Any]:
    """One training batch: `full` rows; `padded` (right padding, lengths tokens/2..tokens, the first row full);
    `packed`: the same sequences in one row by DataCollatorWithFlattening, its cu_seq_lens kwargs included.
    Padded and packed predict the same tokens, so their losses must agree."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=g)
    lengths = [tokens, *torch.randint(tokens // 2, tokens + 1, (batch - 1,), generator=g).tolist()]
    if kind == "full":
        out: dict[str, Any] = {"input_ids": ids, "labels": ids}
    elif kind == "padded":
        keep = torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]
        out = {"input_ids": ids, "attention_mask": keep.long(), "labels": ids.masked_fill(~keep, -100)}
    elif kind == "packed":
        from transformers import DataCollatorWithFlattening

        rows = [{"input_ids": ids[i, :n].tolist()} for i, n in enumerate(lengths)]
        out = dict(DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows, return_tensors="pt"))
    else:
        raise ValueError(f"batch kind {kind!r}: one of {', '.join(BATCHES)}")
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in out.items()}


def train_steps(layers: int, tokens: int, batch: int, iters: int, device: str = "cuda",
                hidden: int = 2048, kinds: tuple[str, ...] = BATCHES) -> dict[str, Any]:
    """Per batch kind: a training step with HF's "sdpa", attnkit and "flash_attention_2" (where installed), eager
    and torch.compile(fullgraph=True): step time, loss, graph breaks (torch._dynamo.explain) and attnkit's
    backends. Keys are "<kind> <impl> <mode>"."""
    import torch
    import transformers

    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")
    from attnkit.runtime import dispatch

    heads = max(2, hidden // 128)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 4), max_position_embeddings=tokens * batch)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device, dtype).train()
    out: dict[str, Any] = {"model": {"layers": layers, "hidden": hidden, "heads": heads,
                                     "kv_heads": config.num_key_value_heads, "head_dim": hidden // heads,
                                     "batch": batch, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                                     "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)},
                           "steps_ms": {}, "loss": {}, "absent": {}, "compile_s": {}, "graph_breaks": {},
                           "attnkit_backends": {}}

    def step_fn(fwd: Any, inputs: dict[str, Any]) -> Any:
        def step() -> Any:
            model.zero_grad(set_to_none=True)
            loss = fwd(**inputs).loss
            loss.backward()
            return loss
        return step

    for kind in kinds:
        inputs = batch_of(kind, batch, tokens, config.vocab_size, device)
        for impl in ("sdpa", "attnkit", "flash_attention_2"):
            try:
                model.set_attn_implementation(impl)
            except Exception as exc:  # flash-attn not installed: a result, not a crash
                out["absent"][f"{kind} {impl}"] = f"{type(exc).__name__}: {first_line(exc)[:200]}"
                continue
            dispatch.invalidate()
            for mode in ("eager", "compiled"):
                name = f"{kind} {impl} {mode}"
                fwd = model
                try:
                    if mode == "compiled":
                        torch._dynamo.reset()
                        explained = torch._dynamo.explain(model)(**inputs)
                        out["graph_breaks"][name] = {"count": explained.graph_break_count,
                                                     "reasons": [first_line(b.reason)[:200]
                                                                 for b in explained.break_reasons][:5]}
                        torch._dynamo.reset()
                        fwd = torch.compile(model, fullgraph=True)
                    step = step_fn(fwd, inputs)
                    t0 = time.perf_counter()
                    loss = step()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if mode == "compiled":
                        out["compile_s"][name] = round(time.perf_counter() - t0, 1)
                    out["loss"][name] = float(loss)
                    out["steps_ms"][name] = round(median_seconds(step, device, warmup=3, iters=iters) * 1e3, 3)
                except Exception as exc:
                    out["absent"][name] = f"{type(exc).__name__}: {first_line(exc)[:300]}"
            if impl == "attnkit":
                out["attnkit_backends"][kind] = sorted({b.backend.name for b in dispatch.bound_calls()})
    ms, loss = out["steps_ms"], out["loss"]
    out["sdpa_baseline_of"] = {kind: sdpa_baseline(kind, kinds) for kind in kinds}
    base = out["sdpa_baseline_of"]
    out["speedup_vs_sdpa_eager"] = {k: round(ms[f"{base[k.split()[0]]} sdpa eager"] / v, 3) for k, v in ms.items()
                                    if f"{base[k.split()[0]]} sdpa eager" in ms}
    out["attnkit_compiled_vs"] = {
        kind: {b: round(ms[name] / ms[f"{kind} attnkit compiled"], 3)
               for b, name in (("attnkit eager", f"{kind} attnkit eager"),
                               ("sdpa compiled", f"{base[kind]} sdpa compiled"),
                               ("sdpa eager", f"{base[kind]} sdpa eager")) if name in ms}
        for kind in kinds if f"{kind} attnkit compiled" in ms}
    out["loss_vs_sdpa_eager"] = {k: round(v - loss[f"{base[k.split()[0]]} sdpa eager"], 5) for k, v in loss.items()
                                 if f"{base[k.split()[0]]} sdpa eager" in loss}
    return out


def sdpa_baseline(kind: str, kinds: tuple[str, ...]) -> str:
    """The batch kind whose HF "sdpa" rows a kind is compared with. A packed batch's are the padded batch's (the same
    tokens): HF's sdpa lets packed sequences see each other (H200, transformers 5.17: loss 10.7923 packed against
    10.8057 padded, docs/results/2026-12-01-h200-integrations-hf-step.json), so its packed step is no baseline."""
    return "padded" if kind == "packed" and "padded" in kinds else kind


def kernels_in_graph() -> dict[str, Any]:
    """CUDA kernels of one attention fwd+bwd, eager and compiled: the same attention kernel must run."""
    import torch

    from attnkit.bench.compiled import kernels
    from attnkit.runtime.attention import attention

    q, k, v = (torch.randn(4, 2048, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (16, 4, 4))

    def f(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, causal=True)

    torch._dynamo.reset()
    runs = {"eager": f, "compiled": torch.compile(f, fullgraph=True)}
    out: dict[str, Any] = {"call": "B4 S2048 H16/4 D128 bf16 causal, fwd+bwd"}
    ref = None
    for name, fn in runs.items():
        for _ in range(3):
            o = fn(q, k, v)
            o.sum().backward()
        torch.cuda.synchronize()
        outs: list[Any] = []

        def step(fn: Any = fn, outs: list[Any] = outs) -> None:
            outs.append(fn(q, k, v))
            outs[-1].sum().backward()
        out[name] = kernels(step)["attention"]
        o = outs[-1]
        if ref is None:
            ref = o.detach()
        else:
            out["max_abs_diff_compiled_vs_eager"] = float((o.detach() - ref).abs().max())
    out["same_kernels"] = out["eager"] == out["compiled"]
    return out


def cuda_graph_decode(replays: int) -> dict[str, Any]:
    import torch

    from attnkit.runtime.attention import attention
    from attnkit.runtime.backends import REGISTRY
    from attnkit.runtime.dispatch import invalidate as clear_cache
    from attnkit.runtime.probe import probe

    b, h, hk, d, cache = 8, 32, 8, 128, 4096
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = rnd(b, 1, h, d), rnd(b, cache, hk, d), rnd(b, cache, hk, d)
    out: dict[str, Any] = {"call": f"decode B{b} Sq1 Sk{cache} H{h}/{hk} D{d} bf16 causal", "replays": replays}

    def capture(backend: str | None, first_call: bool) -> tuple[Any, Any]:
        if not first_call:  # the usual pattern: warm up on a side stream, then capture
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    attention(q, k, v, causal=True, backend=backend)
            torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = attention(q, k, v, causal=True, backend=backend)
        return graph, o

    def replay_all(graph: Any, o: Any, backend: str | None, n: int) -> float:
        worst = 0.0
        for i in range(n):
            q.copy_(rnd(b, 1, h, d))
            row = i % cache  # the step's new key/value written into the cache, as a decode loop does
            k[:, row].copy_(rnd(b, hk, d))
            v[:, row].copy_(rnd(b, hk, d))
            graph.replay()
            ref = attention(q, k, v, causal=True, backend=backend)
            worst = max(worst, float((o - ref).abs().max()))
        return worst

    clear_cache()
    try:
        graph, o = capture(None, first_call=True)
        out["capture_as_first_call"] = {"ok": True, "max_abs_diff": replay_all(graph, o, None, 10)}
    except Exception as exc:
        out["capture_as_first_call"] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        torch.cuda.synchronize()
    clear_cache()
    graph, o = capture(None, first_call=False)
    out["max_abs_diff_vs_eager"] = replay_all(graph, o, None, replays)
    out["identical"] = out["max_abs_diff_vs_eager"] == 0.0
    out["replay_ms"] = round(_median_ms(graph.replay, 200), 4)
    out["eager_ms"] = round(_median_ms(lambda: attention(q, k, v, causal=True), 200), 4)
    from attnkit.runtime.call import Inputs

    call = Inputs(q, k, v, causal=True).describe()
    p = probe()
    per: dict[str, Any] = {}
    for name, backend in REGISTRY.items():
        why = backend.check(call, p)
        if why:
            per[name] = {"serves": False, "why": "; ".join(why)[:200]}
            continue
        try:
            graph, o = capture(name, first_call=False)
            per[name] = {"serves": True, "capture_safe": True, "max_abs_diff": replay_all(graph, o, name, 20)}
        except Exception as exc:
            per[name] = {"serves": True, "capture_safe": False,
                         "error": f"{type(exc).__name__}: {first_line(exc)}"}
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
    out["backends"] = per
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="attnkit bench --integrations", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON report")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--only", choices=("cuda_graph_decode", "kernels_in_graph", "train_step"), action="append",
                    help="run only these parts (repeatable)")
    args = ap.parse_args(argv)
    import json

    import torch

    from attnkit._io import write_atomic
    from attnkit.bench.run import environment

    if not torch.cuda.is_available():
        print("attnkit bench --integrations: needs a CUDA GPU", file=sys.stderr)
        return 1
    report: dict[str, Any] = {"environment": environment(), "torch": torch.__version__}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        report["transformers"] = None
    parts = {"cuda_graph_decode": lambda: cuda_graph_decode(args.replays), "kernels_in_graph": kernels_in_graph}
    if report["transformers"]:
        parts["train_step"] = lambda: train_steps(args.layers, args.tokens, args.batch, args.iters)
    for name, part in parts.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            report[name] = part()
        except Exception:
            report[name] = {"error": traceback.format_exc()[-2000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(report[name])[:1500]}", file=sys.stderr, flush=True)
        write_atomic(Path(args.out), json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
