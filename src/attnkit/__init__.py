"""attnkit: prebuilt attention wheels and images, and one attention() over the fastest working backend.

Importing attnkit is cheap: torch, flash_attn and xformers are imported only when the runtime is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from attnkit.runtime.attention import attention, pack, unpack
    from attnkit.runtime.dispatch import bind
    from attnkit.runtime.probe import probe

_LAZY = {
    "attention": "attnkit.runtime.attention",
    "bind": "attnkit.runtime.dispatch",
    "pack": "attnkit.runtime.attention",
    "unpack": "attnkit.runtime.attention",
    "probe": "attnkit.runtime.probe",
    "select": "attnkit.runtime.select",
}

__all__ = ["__version__", "attention", "bind", "pack", "probe", "select", "unpack"]


def __getattr__(name: str) -> Any:
    """Resolved once, then kept in this module's namespace: `attnkit.attention` in a hot loop (and dynamo's guard
    on it, run on every call of a compiled function) is then a plain attribute read, not this function."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
