"""The backend registry: every backend attnkit knows, by name. One module per backend, imported when first
used (registry.py); `register()` adds one from outside."""

from __future__ import annotations

from attnkit.runtime.backends.base import ArchLimits, Backend, Limits, Runner, reasons
from attnkit.runtime.backends.registry import Registry
from attnkit.runtime.call import Params  # re-exported: what a backend gets besides the call

_M = "attnkit.runtime.backends."
REGISTRY = Registry({
    "sdpa_cudnn": _M + "sdpa_cudnn:SdpaCudnn",
    "cudnn_ragged": _M + "cudnn_ragged:CudnnRagged",
    "sdpa_cudnn_varlen": _M + "sdpa_cudnn_varlen:SdpaCudnnVarlen",
    "flash_attn4": _M + "flash_attn4:FlashAttn4",
    "flash_attn3": _M + "flash_attn3:FlashAttn3",
    "flash_attn2": _M + "flash_attn2:FlashAttn2",
    "sdpa_flash": _M + "sdpa_flash:SdpaFlash",
    "sdpa": _M + "sdpa:Sdpa",
    "torch_varlen": _M + "torch_varlen:TorchVarlen",
    "xformers": _M + "xformers:Xformers",
    "flex_flash": _M + "flex:FlexFlash",
    "flex": _M + "flex:Flex",
    "sdpa_efficient": _M + "sdpa_efficient:SdpaEfficient",
    "sdpa_cpu": _M + "sdpa_cpu:SdpaCpu",
    "sdpa_math": _M + "sdpa_math:SdpaMath",
})
register = REGISTRY.register

__all__ = ["REGISTRY", "ArchLimits", "Backend", "Limits", "Params", "Registry", "Runner", "reasons", "register"]
