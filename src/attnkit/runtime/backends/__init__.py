"""The backend registry: every backend attnkit knows, by name. One module per backend."""

from __future__ import annotations

from attnkit.runtime.backends.base import ArchLimits, Backend, Limits, Runner, reasons
from attnkit.runtime.backends.cudnn_ragged import CudnnRagged
from attnkit.runtime.backends.flash_attn2 import FlashAttn2
from attnkit.runtime.backends.flash_attn3 import FlashAttn3
from attnkit.runtime.backends.flash_attn4 import FlashAttn4
from attnkit.runtime.backends.sdpa import Sdpa
from attnkit.runtime.backends.sdpa_cpu import SdpaCpu
from attnkit.runtime.backends.sdpa_cudnn import SdpaCudnn
from attnkit.runtime.backends.sdpa_cudnn_varlen import SdpaCudnnVarlen
from attnkit.runtime.backends.sdpa_efficient import SdpaEfficient
from attnkit.runtime.backends.sdpa_flash import SdpaFlash
from attnkit.runtime.backends.sdpa_math import SdpaMath
from attnkit.runtime.backends.torch_varlen import TorchVarlen
from attnkit.runtime.backends.xformers import Xformers
from attnkit.runtime.call import Params  # re-exported: what a backend gets besides the call

REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (SdpaCudnn(), CudnnRagged(), SdpaCudnnVarlen(), FlashAttn4(), FlashAttn3(), FlashAttn2(), SdpaFlash(),
              Sdpa(), TorchVarlen(), Xformers(), SdpaEfficient(), SdpaCpu(), SdpaMath())
}

__all__ = ["REGISTRY", "ArchLimits", "Backend", "Limits", "Params", "Runner", "reasons"]
