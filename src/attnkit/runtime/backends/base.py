"""What every backend declares, and the ONE function that turns limits into human-readable reasons.

Backends state their limits as data (like vLLM's attention backends and xformers' fmha operators); whether
a backend can serve a call is decided here, never inside the backend's own code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from attnkit.runtime.call import TRACES, AttentionCall, Params

if TYPE_CHECKING:
    from attnkit.runtime.probe import Probe

Runner = Callable[[Any, Any, Any], Any]  # (q, k, v) -> out, everything else bound


@dataclass(frozen=True)
class Limits:
    devices: frozenset[str] = frozenset({"cuda"})
    min_capability: tuple[int, int] | None = None  # CUDA only
    max_capability: tuple[int, int] | None = None
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16"})
    max_head_dim: int = 256
    extra_head_dims: frozenset[int] = frozenset()  # head dims served above max_head_dim (dedicated kernels)
    head_dim_multiple: int = 1
    head_dim_v_differs: bool = False  # may v's head_dim differ from q/k's?
    gqa: Literal["native", "expand"] = "native"  # expand = k/v heads are materialised to q's count
    dense: bool = True  # serves (batch, seqlen, ...) calls (False: packed varlen only)
    varlen: Literal["native", "padded", "no"] = "no"  # padded = unpack, mask, repack
    causal: bool = True
    window: bool = False
    alibi: bool = False
    # ALiBi as a dense (B, H, Sq, Sk) bias built from the slopes: kept across eager calls (layout.BiasCache, which
    # the sweep times), built again on every call of a torch.compile graph (select.graph_alibi_order)
    alibi_bias: bool = False
    bias: bool = False
    dropout: bool = False
    softcap: bool = False
    backward: bool = True
    deterministic_backward: bool = False
    # graphs that can record the backend's call (call.trace): "compile" needs ops torch.compile can trace
    # (aten ops, torch.library custom ops), "jit" ops the TorchScript tracer and ONNX exporter know
    traces: frozenset[str] = frozenset()


GRAPH_TRACES = frozenset({"compile", "jit"})  # torch's own SDPA: recorded by both graphs


@dataclass(frozen=True)
class ArchLimits:
    """Limits that hold on compute capabilities [min_capability, max_capability] (a library whose kernels
    differ per architecture, like FlashAttention-4's sm90 / sm100 / sm120 paths, declares one row each)."""

    min_capability: tuple[int, int]
    max_capability: tuple[int, int]
    limits: Limits


def _cc(c: tuple[int, int]) -> str:
    return f"{c[0]}.{c[1]}"


def reasons(limits: Limits | tuple[ArchLimits, ...], call: AttentionCall,
            capability: tuple[int, int] | None) -> list[str]:
    """Every reason `limits` rule out `call` on a device of `capability`; [] means it can serve."""
    out: list[str] = []
    if isinstance(limits, tuple):  # per-architecture rows: the row for this GPU, or why there is none
        rows = limits
        if call.device == "cuda" and capability is not None:
            row = next((r for r in rows if r.min_capability <= capability <= r.max_capability), None)
            if row is None:
                spans = ", ".join(_cc(r.min_capability) if r.min_capability == r.max_capability
                                  else f"{_cc(r.min_capability)}-{_cc(r.max_capability)}" for r in rows)
                return [f"has kernels for compute capability {spans}, GPU is sm{capability[0]}{capability[1]}"]
            limits = row.limits
        else:
            limits = rows[0].limits
    if call.device not in limits.devices:
        out.append(f"runs on {'/'.join(sorted(limits.devices))}, not {call.device}")
    elif call.device == "cuda" and capability is not None:
        cc = f"sm{capability[0]}{capability[1]}"
        if limits.min_capability and capability < limits.min_capability:
            out.append(f"needs compute capability >= {limits.min_capability[0]}.{limits.min_capability[1]}, GPU is {cc}")
        if limits.max_capability and capability > limits.max_capability:
            out.append(f"needs compute capability <= {limits.max_capability[0]}.{limits.max_capability[1]}, GPU is {cc}")
    if call.dtype not in limits.dtypes:
        out.append(f"dtype {call.dtype} not supported (supports {', '.join(sorted(limits.dtypes))})")
    widest = max(call.head_dim, call.head_dim_v)
    if widest > limits.max_head_dim and widest not in limits.extra_head_dims:
        extra = f" (or exactly {', '.join(map(str, sorted(limits.extra_head_dims)))})" if limits.extra_head_dims else ""
        out.append(f"head_dim {widest} > {limits.max_head_dim}{extra}")
    if call.head_dim % limits.head_dim_multiple or call.head_dim_v % limits.head_dim_multiple:
        out.append(f"head_dim must be a multiple of {limits.head_dim_multiple}")
    if call.head_dim_v != call.head_dim and not limits.head_dim_v_differs:
        out.append("needs v's head_dim equal to q's")
    if call.varlen and limits.varlen == "no":
        out.append("no varlen (cu_seqlens) support")
    if not call.varlen and not limits.dense:
        out.append("serves only varlen (cu_seqlens) calls")
    if call.causal and not limits.causal:
        out.append("no causal support")
    if call.window is not None and not limits.window:
        out.append("no sliding-window support")
    if call.alibi and not limits.alibi:
        out.append("no ALiBi support")
    if call.bias and not limits.bias:
        out.append("no attn_bias support")
    if call.dropout and not limits.dropout:
        out.append("no dropout support")
    if call.softcap and not limits.softcap:
        out.append("no softcap support")
    if call.requires_grad and not limits.backward:
        out.append("forward only (no backward)")
    if call.deterministic and not limits.deterministic_backward:
        out.append("backward is not deterministic (torch.use_deterministic_algorithms is on)")
    if call.trace and call.trace not in limits.traces:
        out.append(f"its call cannot be recorded by {TRACES[call.trace]}")
    elif call.trace == "compile" and call.varlen and limits.varlen == "padded":
        out.append("varlen through padding reads the sequence lengths on the host, which torch.compile cannot trace")
    return out


class Backend:
    """A backend: a name, limits as data, an availability check, run() and bind()."""

    name: str = ""
    limits: Limits | tuple[ArchLimits, ...] = Limits()
    library: str | None = None  # probe's library name this backend needs, if any
    # its first call of each configuration compiles a kernel (kept in a disk cache across processes): what the
    # tune sweep's compile phase and `bench --compiled` run ahead of timing; the others have nothing to compile
    compiles: bool = False

    def first_limits(self) -> Limits:
        """Its limits, or those of its first architecture row: the features it declares at all (what doctor lists
        and rule 5 reads), not whether this GPU gets them (`reasons` decides that)."""
        return self.limits[0].limits if isinstance(self.limits, tuple) else self.limits

    def unavailable(self, probe: Probe) -> list[str]:
        """Reasons this backend cannot run on this machine at all (library missing, torch too old)."""
        if probe.torch is None:
            return [probe.torch_error or "torch is not installed"]
        if self.library is not None:
            lib = probe.library(self.library)
            if lib is None or not lib.installed:
                return [f"{self.library} is not installed"]
            if lib.checked and not lib.loads:
                return [f"{self.library} {lib.version} does not load: {lib.error}"]
        return self.extra_unavailable(probe)

    def extra_unavailable(self, probe: Probe) -> list[str]:
        return []

    def import_library(self) -> float | None:
        """Import the backend's library now (one whose import the probe defers because it is slow); returns how
        long the process's import took, in seconds."""
        return None

    def extra_reasons(self, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
        """Reasons of this backend's own, beyond the common Limits (as xformers' operators extend
        not_supported_reasons): a fact only one backend has stays in that backend."""
        return []

    def check(self, call: AttentionCall, probe: Probe, waive: tuple[str, ...] = ()) -> list[str]:
        """Every reason this backend cannot serve `call` here. `waive`: machine-wide reasons to pass over (an
        opt-in that guards attention()'s picks, not a benchmark's call of the library itself)."""
        why = self.unavailable(probe)
        if waive:
            why = [r for r in why if r not in waive]
        if why:
            return why
        cap = probe.capability(call.device_index) if call.device == "cuda" else None
        return reasons(self.limits, call, cap) + self.extra_reasons(call, cap)

    def run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:
        """One call, nothing reused (the smoke and the bench's forced candidates go through bind() too)."""
        return self.bind(call, p, q, k, v)(q, k, v)

    def bind(self, call: AttentionCall, p: Params, q: Any, k: Any, v: Any) -> Runner:
        """A runner specialised for `call`: whatever depends only on the call (arguments, masks, the route to
        the kernel) is worked out here, once; the runner does the per-call work only. attention() caches it
        per call signature, so a repeated call costs a dictionary lookup plus the kernel's own call.
        q, k, v are this call's tensors, for backends whose route depends on them (strides, grad)."""
        return lambda q, k, v: self.compute(q, k, v, call, p)

    def compute(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:  # pragma: no cover
        """The per-call work of a backend that has nothing to prepare (override bind() otherwise)."""
        raise NotImplementedError(f"backend {self.name} defines neither compute() nor bind()")
