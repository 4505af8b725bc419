"""torch.compile's own host cost per call, on any machine (CPU is enough): how much of a compiled attention step's
host time is torch's, and how much is attnkit's, for the compile issue's parity figures.

1. One custom op (torch.library, Python impl, register_autograd) compiled with fullgraph, against the same op in an
   eager autograd.Function: torch.compile's fixed cost per forward and per fwd+bwd step of a one-op graph.
2. attention() (the sdpa backend on the CPU) compiled against the plain F.scaled_dot_product_attention call compiled:
   what attnkit's traced code adds under compile.
3. Where a graph's autograd formula lives, for an op pair with FlashAttention-4's schemas (fa4_ops.py): a Python
   autograd kernel on the ops (torch.library.register_autograd, which the compiled graph enters on every call,
   grad on or off), against an autograd.Function over the same ops without one (attnkit's graph_function), which
   AOTAutograd traces into the same forward and backward graphs.
Tiny tensors, so kernels cost ~nothing and the medians are host time.

    python tools/probe-compile-host.py [OUT.json]
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnkit

warnings.filterwarnings("ignore")


def median_us(step: Callable[[], Any], grad: bool, n: int = 2000, rounds: int = 5) -> float:
    with torch.enable_grad() if grad else torch.no_grad():
        for _ in range(100):
            step()
        per = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            per.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(per), 1)


def one_op() -> dict[str, float]:
    lib = torch.library.Library("hostprobe", "FRAGMENT")
    lib.define("fwd(Tensor q) -> (Tensor, Tensor)")
    lib.define("bwd(Tensor g, Tensor q) -> Tensor")
    lib.impl("fwd", lambda q: (q.clone(), q.new_empty(q.shape[:-1])), "CPU")
    lib.impl("bwd", lambda g, q: g.clone(), "CPU")
    torch.library.register_fake("hostprobe::fwd", lambda q: (torch.empty_like(q), q.new_empty(q.shape[:-1])), lib=lib)
    torch.library.register_fake("hostprobe::bwd", lambda g, q: torch.empty_like(g), lib=lib)

    def setup(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    torch.library.register_autograd("hostprobe::fwd", lambda ctx, g, _lse: torch.ops.hostprobe.bwd(
        g, ctx.saved_tensors[0]), setup_context=setup, lib=lib)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any) -> Any:
            ctx.save_for_backward(q)
            return torch.ops.hostprobe.fwd(q)[0]

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return torch.ops.hostprobe.bwd(g, ctx.saved_tensors[0])

    q = torch.randn(2, 64, 4, 16, requires_grad=True)
    g = torch.randn_like(q)
    op = lambda x: torch.ops.hostprobe.fwd(x)[0]  # noqa: E731
    compiled = torch.compile(op, fullgraph=True)
    fn = {"eager autograd.Function": Eager.apply, "compiled op": compiled}
    out = {f"fwd+bwd {n}": median_us(lambda f=f: f(q).backward(g), True) for n, f in fn.items()}
    out.update({f"fwd {n}": median_us(lambda f=f: f(q), False) for n, f in fn.items()})
    return out


def attention_vs_plain() -> dict[str, float]:
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)

    def ours(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attention(q, k, v, causal=True)

    def plain(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    fns = {"attention() eager": ours, "attention() compiled": torch.compile(ours, fullgraph=True),
           "plain eager": plain, "plain compiled": torch.compile(plain, fullgraph=True)}
    out = {f"fwd {n}": median_us(lambda f=f: f(q, k, v), False) for n, f in fns.items()}
    out.update({f"fwd+bwd {n}": median_us(lambda f=f: f(q, k, v).backward(g), True) for n, f in fns.items()})
    return out


_FWD = ("(Tensor q, Tensor k, Tensor v, Tensor? cq, Tensor? ck, SymInt mq, SymInt mk, float s, bool c, int wl, "
        "int wr, float cap) -> (Tensor, Tensor)")
_BWD = ("(Tensor g, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? cq, Tensor? ck, SymInt mq, SymInt mk, "
        "float s, bool c, int wl, int wr, float cap, bool det) -> (Tensor, Tensor, Tensor)")
_ARGS = (None, None, -1, -1, 0.25, True, 128, 0, 0.0)


def _op_pair(ns: str, autograd: bool) -> Any:
    """fwd/bwd ops with FA4's schemas and trivial CPU kernels; with `autograd`, register_autograd on both (the bwd's
    kernel refuses a double backward, as attnkit's did)."""
    lib = torch.library.Library(ns, "DEF")
    _KEEP.append(lib)
    lib.define("fwd" + _FWD)
    lib.define("bwd" + _BWD)
    lib.impl("fwd", lambda q, k, v, *a: (q.clone(), q.new_empty(q.shape[:-1])), "CPU")
    lib.impl("bwd", lambda g, q, k, v, *a: (g.clone(), torch.empty_like(k), torch.empty_like(v)), "CPU")
    torch.library.register_fake(f"{ns}::fwd", lambda q, k, v, *a: (torch.empty_like(q), q.new_empty(q.shape[:-1])),
                                lib=lib)
    torch.library.register_fake(f"{ns}::bwd", lambda g, q, k, v, *a: (torch.empty_like(q), torch.empty_like(k),
                                                                      torch.empty_like(v)), lib=lib)
    ops = getattr(torch.ops, ns)
    if autograd:
        def setup(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_backward(*inputs[:3], *output)

        def backward(ctx: Any, g: Any, _lse: Any) -> Any:
            q, k, v, o, lse = ctx.saved_tensors
            return (*ops.bwd(g, q, k, v, o, lse, *_ARGS, False), *(None,) * 9)

        def refuse(ctx: Any, *grads: Any) -> Any:
            raise RuntimeError("no double backward")

        torch.library.register_autograd(f"{ns}::fwd", backward, setup_context=setup, lib=lib)
        torch.library.register_autograd(f"{ns}::bwd", refuse, lib=lib)
    return ops


_KEEP: list[Any] = []


def autograd_kernel_vs_function() -> dict[str, float]:
    with_kernel, bare = _op_pair("hostprobe_ag", True), _op_pair("hostprobe_bare", False)

    class OverBareOps(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            o, lse = bare.fwd(q, k, v, *_ARGS)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            q, k, v, o, lse = ctx.saved_tensors
            return bare.bwd(g, q, k, v, o, lse, *_ARGS, False)

    q, k, v = (torch.randn(2, 64, 4, 16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    fns = {"register_autograd on the ops": lambda q, k, v: with_kernel.fwd(q, k, v, *_ARGS)[0],
           "autograd.Function over ops without autograd kernel": OverBareOps.apply}
    out = {}
    for name, f in fns.items():
        compiled = torch.compile(f, fullgraph=True)
        out[f"fwd+bwd eager {name}"] = median_us(lambda f=f: f(q, k, v).backward(g), True)
        out[f"fwd+bwd compiled {name}"] = median_us(lambda c=compiled: c(q, k, v).backward(g), True)
    return out


def main() -> None:
    report = {"what": __doc__.split("\n\n")[0], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
              "cpus": __import__("os").cpu_count(), "unit": "us per call, median of 5 rounds",
              "one_custom_op": one_op(), "attention_vs_plain_sdpa": attention_vs_plain(),
              "fa4_autograd_kernel_vs_function": autograd_kernel_vs_function()}
    text = json.dumps(report, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
