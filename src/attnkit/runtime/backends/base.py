"""What every backend declares, and the ONE function that turns limits into human-readable reasons.

Backends state their limits as data (like vLLM's attention backends and xformers' fmha operators); whether
a backend can serve a call is decided here, never inside the backend's own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from attnkit.runtime.call import AttentionCall
    from attnkit.runtime.probe import Probe


@dataclass(frozen=True)
class Limits:
    devices: frozenset[str] = frozenset({"cuda"})
    min_capability: tuple[int, int] | None = None  # CUDA only
    max_capability: tuple[int, int] | None = None
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16"})
    max_head_dim: int = 256
    head_dim_multiple: int = 1
    head_dim_v_differs: bool = False  # may v's head_dim differ from q/k's?
    gqa: Literal["native", "expand"] = "native"  # expand = k/v heads are materialised to q's count
    padded: bool = True  # serves (batch, seqlen, ...) calls
    varlen: Literal["native", "padded", "no"] = "no"  # padded = unpack, mask, repack
    varlen_same_lengths_only: bool = False  # varlen only when cu_seqlens_q == cu_seqlens_k
    varlen_causal_more_queries: bool = True  # varlen causal where a sequence has more queries than keys
    causal: bool = True
    causal_unequal: bool = True  # bottom-right causal when seqlen_q != seqlen_k
    window: bool = False
    alibi: bool = False
    bias: bool = False
    dropout: bool = False
    backward: bool = True
    deterministic_backward: bool = False


def reasons(limits: Limits, call: AttentionCall, capability: tuple[int, int] | None) -> list[str]:
    """Every reason `limits` rule out `call` on a device of `capability`; [] means it can serve."""
    out: list[str] = []
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
    if max(call.head_dim, call.head_dim_v) > limits.max_head_dim:
        out.append(f"head_dim {max(call.head_dim, call.head_dim_v)} > {limits.max_head_dim}")
    if call.head_dim % limits.head_dim_multiple or call.head_dim_v % limits.head_dim_multiple:
        out.append(f"head_dim must be a multiple of {limits.head_dim_multiple}")
    if call.head_dim_v != call.head_dim and not limits.head_dim_v_differs:
        out.append("needs v's head_dim equal to q's")
    if call.varlen and limits.varlen == "no":
        out.append("no varlen (cu_seqlens) support")
    if call.varlen and limits.varlen_same_lengths_only and not call.varlen_same:
        out.append("varlen only with cu_seqlens_q == cu_seqlens_k (self-attention)")
    if (call.varlen and call.causal and not limits.varlen_causal_more_queries
            and any(lq > lk for lq, lk in zip(call.lengths_q or (), call.lengths_k or (), strict=True))):
        out.append("varlen causal only when every sequence has at least as many keys as queries")
    if not call.varlen and not limits.padded:
        out.append("serves only varlen (cu_seqlens) calls")
    if call.causal and not limits.causal:
        out.append("no causal support")
    if call.causal and call.seqlen_q != call.seqlen_k and not limits.causal_unequal:
        out.append("causal only when seqlen_q == seqlen_k (no bottom-right alignment)")
    if call.window is not None and not limits.window:
        out.append("no sliding-window support")
    if call.alibi and not limits.alibi:
        out.append("no ALiBi support")
    if call.bias and not limits.bias:
        out.append("no attn_bias support")
    if call.dropout and not limits.dropout:
        out.append("no dropout support")
    if call.requires_grad and not limits.backward:
        out.append("forward only (no backward)")
    if call.deterministic and not limits.deterministic_backward:
        out.append("backward is not deterministic (torch.use_deterministic_algorithms is on)")
    return out


@dataclass
class Params:
    """Runtime values a backend needs beyond the call's description."""

    scale: float
    dropout_p: float
    window: tuple[int, int] | None
    alibi_slopes: Any = None
    attn_bias: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Backend:
    """A backend: a name, limits as data, an availability check, and run()."""

    name: str = ""
    limits: Limits = Limits()
    library: str | None = None  # probe's library name this backend needs, if any

    def unavailable(self, probe: Probe) -> list[str]:
        """Reasons this backend cannot run on this machine at all (library missing, torch too old)."""
        if probe.torch is None:
            return ["torch is not installed"]
        if self.library is not None:
            lib = probe.library(self.library)
            if lib is None or not lib.installed:
                return [f"{self.library} is not installed"]
            if not lib.loads:
                return [f"{self.library} {lib.version} does not load: {lib.error}"]
        return self.extra_unavailable(probe)

    def extra_unavailable(self, probe: Probe) -> list[str]:
        return []

    def check(self, call: AttentionCall, probe: Probe) -> list[str]:
        why = self.unavailable(probe)
        if why:
            return why
        cap = probe.capability(call.device_index) if call.device == "cuda" else None
        return reasons(self.limits, call, cap)

    def run(self, q: Any, k: Any, v: Any, call: AttentionCall, p: Params) -> Any:  # pragma: no cover
        raise NotImplementedError
